"""The in-process polylane engine as a bench client, and its counters.

What this module owns: building the engine a bench system runs (`polylane`: as served, prefix
cache on, the first model speculating when the setup says how; `plain`: prefix cache and
speculation off), warming it up, sending one `BenchRequest` through `Engine.submit` and timing its
stream events, and reading `Engine.stats()` into `EngineCounters`. It does not decide what to run
(the harness) or compute any metric (`metrics`).

Model sources: a catalogue name or a path, or `sibling:N` — the first model's sibling with its top
N layers changed by a seeded perturbation (`polylane models sibling`, seed 1), written once under
the cache and reused (`runtime.residency.siblings.ensure_sibling`): it shares the band `[0, layers − N)` with
the first model.

Speculation counters: `engine_counters` sums `stats.speculation` (one snapshot per (target,
drafter) pair with `draft_tokens`, `accepted_tokens`, `emitted_tokens`, `rounds` i.e. verify
passes, chain and tree rounds and on/off decisions, counted since the engine started); with no
pair they are None and the report shows them as not measured. Cross-model prefill share: per
consumer model, `stats.models[name].cross_model_hits` and `cross_model_tokens`, and the layer-tokens
the share skipped (from the runner's `LayerShare`, where it exposes them).
"""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from polylane.bench.metrics import EngineCounters, RequestTimeline, SpeculationCounters
from polylane.bench.replay import Clock, error_timeline
from polylane.bench.workloads import BenchRequest, document
from polylane.engine import Engine, EngineConfig, RequestHandle
from polylane.grammar_spec import grammar_for
from polylane.policy.scheduling.scheduler import SchedulerConfig
from polylane.runtime.residency.manager import ResidencyManager
from polylane.types import DEFAULT_DTYPE, SamplingParams


@dataclass(frozen=True)
class EngineSetup:
    """How to build the engine of one bench system."""

    models: tuple[tuple[str, str], ...]  # (served name, catalogue name or path)
    dtype: str = DEFAULT_DTYPE
    budget_bytes: int = 64 * 2**30
    kv_tokens: int = 2048
    lane_policy: str = "throughput"
    prefix_cache: bool = True
    device: str = "auto"  # where the engine's models run (`runtime.model.device`)
    threads: int = 0  # compute threads (0: adapt to the machine's load, `EngineConfig.threads`)
    # The first model's speculation, as `Engine.add_model(speculation=...)` takes it (JSON-able:
    # True, drafter names, or a dict of `SpeculationConfig` fields); None: no speculation.
    speculation: Any = None


SIBLING_PREFIX = "sibling:"
SIBLING_SEED = 1  # the seed bench/layer_share.py uses too: one sibling file on disk for both


def resolve_source(source: str, models: tuple[tuple[str, str], ...]) -> str:
    """`source` as `Engine.add_model` takes it: `sibling:N` becomes the path of the first model's
    sibling with its top N layers changed (written now if it is not on disk yet)."""
    if not source.startswith(SIBLING_PREFIX):
        return source
    from polylane.runtime.residency.siblings import SiblingSpec, ensure_sibling

    top_layers = int(source.removeprefix(SIBLING_PREFIX))
    provider = models[0][1]
    if provider.startswith(SIBLING_PREFIX):
        raise ValueError("the first model (the provider of a sibling) cannot itself be a sibling:N")
    return str(ensure_sibling(provider, SiblingSpec(top_layers=top_layers, seed=SIBLING_SEED), quiet=True))


def open_engine(setup: EngineSetup) -> Engine:
    """An engine serving `setup.models`, each loaded and warmed up (a document prefill and a
    two-request decode per model; then, when the first model speculates, one more decode of it
    with every drafter resident), so that no timed request pays a load or a first-call cost."""
    manager = ResidencyManager(setup.budget_bytes, prefix_cache=setup.prefix_cache, device=setup.device)
    config = EngineConfig(
        setup.budget_bytes,
        scheduler=SchedulerConfig(lane_policy=setup.lane_policy),
        device=setup.device,
        threads=setup.threads,
    )
    engine = Engine(config, manager=manager)
    try:
        for index, (name, source) in enumerate(setup.models):
            engine.add_model(
                name,
                resolve_source(source, setup.models),
                dtype=setup.dtype,
                kv_tokens=setup.kv_tokens,
                speculation=setup.speculation if index == 0 else None,
            )
        warm = "Warm-up. " + document(random.Random(0), 96)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        for name, _ in setup.models:
            engine.generate(name, warm, params)
            handles = [engine.submit(name, f"Warm-up {i}: hello", params=params) for i in range(2)]
            for handle in handles:
                _check_warm_up(name, handle.result())
        if setup.speculation is not None:  # the drafters are resident now: a speculative decode
            target = setup.models[0][0]
            text = "Repeat this list exactly: " + ", ".join(f"item {i}" for i in range(24))
            _check_warm_up(target, engine.generate(target, text, SamplingParams(max_tokens=24)))
    except BaseException:
        engine.close()
        raise
    return engine


def _check_warm_up(name: str, completion: Any) -> None:
    if completion.finish_reason == "error":
        raise RuntimeError(f"warm-up of {name!r} failed: {completion.error}")


# Threads that submit requests (render the chat template, tokenise, queue), as many as the
# server's request thread pool has (anyio's default limiter): asyncio's default executor has
# min(32, cores + 4), 6 on 2 cores, so 8 requests "sent at once" reached the engine as 6 and then 2.
SUBMIT_THREADS = 40


class EngineClient:
    """Sends bench requests to an in-process engine (greedy), timing each stream event."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.in_flight: dict[str, RequestHandle] = {}  # bench request id → its handle, until it ends
        self._submitter = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="bench-submit")

    def close(self) -> None:
        self._submitter.shutdown(wait=False, cancel_futures=True)

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
        try:
            params = SamplingParams(
                max_tokens=request.max_tokens,
                ignore_eos=request.ignore_eos,
                grammar=grammar_for("json_schema", json.loads(request.json_schema))
                if request.json_schema
                else None,
            )
            handle = await asyncio.get_running_loop().run_in_executor(
                self._submitter, self._submit, request, params
            )
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
        cross_model_hits={n: m.cross_model_hits for n, m in stats.models.items() if m.cross_model_hits},
        cross_model_tokens={n: m.cross_model_tokens for n, m in stats.models.items() if m.cross_model_tokens},
        cross_model_layer_tokens=_skipped_layer_tokens(engine),
    )


def _skipped_layer_tokens(engine: Engine) -> dict[str, int]:
    """Per consumer model, the layer-tokens the cross-model share did not compute (empty where the
    runner does not expose its `LayerShare`)."""
    sharing = getattr(getattr(engine, "runner", None), "sharing", None)
    if sharing is None or not hasattr(sharing, "stats"):
        return {}
    return {name: s.skipped_layer_tokens for name, s in sharing.stats().items() if s.skipped_layer_tokens}


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
        total("chain_rounds"),
        total("tree_rounds"),
        total("decisions_on"),
        total("decisions_off"),
    )
