"""The in-process polylane engine as a bench client, and its counters.

What this module owns: building the engine a bench system runs (`polylane`: as served, prefix
cache on; `plain`: prefix cache off, and speculation off once the engine has it), warming it up,
sending one `BenchRequest` through `Engine.submit` and timing its stream events, and reading
`Engine.stats()` into `EngineCounters`. It does not decide what to run (the harness) or compute
any metric (`metrics`).

Speculation counters: `engine_counters` sums `stats.speculation` when the engine has it (one
snapshot per (target, drafter) pair with `draft_tokens`, `accepted_tokens`, `emitted_tokens` and
`rounds`, i.e. verify passes, counted since the engine started); without it they are None and the
report shows them as not measured.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from polylane.bench.metrics import EngineCounters, RequestTimeline, SpeculationCounters
from polylane.bench.replay import Clock, error_timeline
from polylane.bench.workloads import BenchRequest, document
from polylane.engine import Engine, EngineConfig, RequestHandle
from polylane.policy.scheduler import SchedulerConfig
from polylane.runtime.residency import ResidencyManager
from polylane.types import SamplingParams


@dataclass(frozen=True)
class EngineSetup:
    """How to build the engine of one bench system."""

    models: tuple[tuple[str, str], ...]  # (served name, catalogue name or path)
    dtype: str = "fp32"
    budget_bytes: int = 64 * 2**30
    kv_tokens: int = 2048
    lane_policy: str = "throughput"
    prefix_cache: bool = True


def open_engine(setup: EngineSetup) -> Engine:
    """An engine serving `setup.models`, each loaded and warmed up (a document prefill and a
    two-request decode per model), so that no timed request pays a load or a first-call cost."""
    manager = ResidencyManager(setup.budget_bytes, prefix_cache=setup.prefix_cache)
    config = EngineConfig(setup.budget_bytes, scheduler=SchedulerConfig(lane_policy=setup.lane_policy))
    engine = Engine(config, manager=manager)
    try:
        for name, source in setup.models:
            engine.add_model(name, source, dtype=setup.dtype, kv_tokens=setup.kv_tokens)
        warm = "Warm-up. " + document(random.Random(0), 96)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        for name, _ in setup.models:
            engine.generate(name, warm, params)
            handles = [engine.submit(name, f"Warm-up {i}: hello", params=params) for i in range(2)]
            for handle in handles:
                completion = handle.result()
                if completion.finish_reason == "error":
                    raise RuntimeError(f"warm-up of {name!r} failed: {completion.error}")
    except BaseException:
        engine.close()
        raise
    return engine


class EngineClient:
    """Sends bench requests to an in-process engine (greedy), timing each stream event."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.in_flight: dict[str, RequestHandle] = {}  # bench request id → its handle, until it ends

    def describe_in_flight(self) -> str:
        """What the requests still in flight are doing (for a phase that timed out)."""
        lines = []
        for request_id, handle in self.in_flight.items():
            lines.append(
                f"{request_id}: engine request {handle.id}, done {handle.done}, "
                f"{len(handle._events)} events, first token {'yes' if handle.first_token_at else 'no'}"
            )
        return "\n".join(lines) or "none"

    def _submit(self, request: BenchRequest, params: SamplingParams) -> RequestHandle:
        served = self.engine.models.get(request.model)
        if request.chat and served is not None and served.tokenizer.has_chat_template:
            return self.engine.submit(request.model, messages=request.messages(), params=params)
        return self.engine.submit(request.model, request.text(), params=params)

    async def send(self, request: BenchRequest, now: Clock) -> RequestTimeline:
        sent = now()
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=request.ignore_eos)
        try:
            handle = await asyncio.to_thread(self._submit, request, params)
        except Exception as error:  # refused before queueing (too long, unknown model)
            return error_timeline(request, sent, error)
        first: float | None = None
        last: float | None = None
        self.in_flight[request.request_id] = handle
        async for event in handle:
            if event.token_ids:
                last = now()
                if first is None:
                    first = last
        del self.in_flight[request.request_id]
        completion = handle.result(timeout=0)
        return RequestTimeline(
            request.request_id,
            request.model,
            request.category,
            sent,
            first,
            last,
            completion.prompt_tokens,
            completion.cached_tokens,
            len(completion.token_ids),
            completion.finish_reason,
            completion.error,
        )


def engine_counters(engine: Engine) -> EngineCounters:
    """The engine's counters now (since it started)."""
    stats = engine.stats()
    pool = stats.residency.pool
    return EngineCounters(
        steps=stats.steps,
        decode_steps=stats.decode_steps,
        switches=stats.switches,
        preemptions=stats.preemptions,
        decode_tokens=stats.decode_tokens,
        prefill_tokens=stats.prefill_tokens,
        lane_steps={name: model.lane_steps for name, model in stats.models.items() if model.lane_steps},
        max_concurrent_decode=stats.max_concurrent_decode,
        residency_hits=pool.hits,
        residency_misses=pool.misses,
        residency_evictions=pool.num_evictions,
        page_in_seconds=stats.residency.load_seconds,
        speculation=_speculation(stats),
    )


def _speculation(stats: object) -> SpeculationCounters | None:
    """Speculation counters summed over `stats.speculation`: one snapshot per (target, drafter)
    pair, or one object; None when the engine has none or nothing has speculated yet."""
    spec = getattr(stats, "speculation", None)
    if not spec:
        return None
    pairs = spec if isinstance(spec, tuple | list) else (spec,)

    def total(*names: str) -> int:
        return sum(int(next((getattr(p, n) for n in names if hasattr(p, n)), 0)) for p in pairs)

    return SpeculationCounters(
        total("draft_tokens", "drafted_tokens"),
        total("accepted_tokens"),
        total("emitted_tokens"),
        total("rounds", "verify_steps"),
    )
