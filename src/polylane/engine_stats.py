"""Engine statistics: per model and overall, read by tests, `/metrics` and the benchmarks.

What this module owns: the recorder the engine thread feeds (submits, first tokens, finishes,
steps) and the `EngineStats` snapshot built from it, the scheduler's counters, the lane monitor
(the observed number of models decoding at once, never a constant) and the residency counters.

Switch cost: a decode step whose lane owner differs from the previous decode step's is a switch
step. Steps are compared like for like: per (model, decode batch size), over steps that decode
only (a step that also prefills takes longer for another reason), the switch steps' mean seconds
against the other steps' mean. `switch_overhead` = the sum over those keys of switch steps ×
(their mean − the steady mean), over total decode seconds: the share of lane time that switching
cost (≤ 0: none seen; keys with no steady step to compare against are left out).
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from typing import Any

from polylane.policy.scheduling.lane import LaneMonitor
from polylane.policy.scheduling.scheduler import SchedulerCounters
from polylane.types import StepPlan, StepResult


@dataclass
class ModelStats:
    requests: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    output_tokens: int = 0
    ttft_seconds: list[float] = field(default_factory=list)
    tpot_seconds: list[float] = field(default_factory=list)
    lane_steps: int = 0
    lane_share: float = 0.0  # of all decode steps
    prefix_hit_rate: float = 0.0  # matched / looked-up prompt tokens (while resident)
    prefix_matched_tokens: int = 0
    cross_model_hits: int = 0  # sequences that reused another model's prefix (shared layer band)
    cross_model_tokens: int = 0  # prompt tokens whose lower-band KV came from another model
    forced_tokens: int = 0  # tokens a grammar forced, verified in speculative passes (jump-forward)


@dataclass(frozen=True)
class EngineStats:
    steps: int
    decode_steps: int
    switches: int
    preemptions: int
    prefill_tokens: int
    decode_tokens: int
    prefill_tokens_per_step: float  # over steps with prefill
    decode_tokens_per_step: float  # decode batch size, over decode steps
    max_concurrent_decode: int  # observed by the lane monitor
    max_concurrent_drafters: int
    decode_seconds: float
    switch_overhead: float
    models: dict[str, ModelStats]
    residency: Any  # ManagerCounters
    speculation: tuple[Any, ...] = ()  # a `runtime.speculation.setup.PairSnapshot` per (target, drafter)

    @property
    def lane_share(self) -> dict[str, float]:
        return {name: m.lane_share for name, m in self.models.items()}


class StatsRecorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelStats] = {}
        self._prefill_steps = 0
        self._decode_seconds = 0.0
        self._last_lane: str | None = None
        # (model, batch) → [switch seconds, switch steps, steady seconds, steady steps], decode-only steps
        self._step_seconds: dict[tuple[str, int], list[float]] = {}

    def _model(self, name: str) -> ModelStats:
        return self._models.setdefault(name, ModelStats())

    def submitted(self, model: str) -> None:
        with self._lock:
            self._model(model).requests += 1

    def first_token(self, model: str, ttft: float) -> None:
        with self._lock:
            self._model(model).ttft_seconds.append(ttft)

    def finished(self, model: str, reason: str, tokens: int, handle: Any) -> None:
        with self._lock:
            stats = self._model(model)
            stats.finished[reason] = stats.finished.get(reason, 0) + 1
            stats.output_tokens += tokens
            if handle.first_token_at is not None and tokens > 1:
                stats.tpot_seconds.append((handle.last_token_at - handle.first_token_at) / (tokens - 1))

    def step(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        with self._lock:
            if plan.prefill:
                self._prefill_steps += 1
            if plan.decode_model is None or not plan.decode:
                return
            if result.forced_tokens:
                self._models.setdefault(plan.decode_model, ModelStats()).forced_tokens += result.forced_tokens
            self._decode_seconds += seconds
            switched = self._last_lane not in (None, plan.decode_model)
            self._last_lane = plan.decode_model
            if plan.prefill:
                return
            sums = self._step_seconds.setdefault((plan.decode_model, len(plan.decode)), [0.0, 0, 0.0, 0])
            offset = 0 if switched else 2
            sums[offset] += seconds
            sums[offset + 1] += 1

    def snapshot(
        self,
        counters: SchedulerCounters,
        monitor: LaneMonitor,
        residency: Any,
        prefix: dict[str, Any],
        cross_model: dict[str, Any] | None = None,
        speculation: list[Any] | None = None,
    ) -> EngineStats:
        with self._lock:
            models = {
                name: ModelStats(
                    m.requests,
                    dict(m.finished),
                    m.output_tokens,
                    list(m.ttft_seconds),
                    list(m.tpot_seconds),
                    forced_tokens=m.forced_tokens,
                )
                for name, m in self._models.items()
            }
            lane_steps = dict(counters.lane_steps)
            extra = sum(
                switch_steps * (switch_seconds / switch_steps - steady_seconds / steady_steps)
                for switch_seconds, switch_steps, steady_seconds, steady_steps in self._step_seconds.values()
                if switch_steps and steady_steps
            )
            overhead = extra / self._decode_seconds if self._decode_seconds else 0.0
            decode_seconds, prefill_steps = self._decode_seconds, self._prefill_steps
        for name, steps in lane_steps.items():
            stats = models.setdefault(name, ModelStats())
            stats.lane_steps = steps
            stats.lane_share = steps / max(1, counters.decode_steps)
        for name, tree in prefix.items():
            stats = models.setdefault(name, ModelStats())
            stats.prefix_hit_rate = tree.hit_rate
            stats.prefix_matched_tokens = tree.matched_tokens
        for name, cross in (cross_model or {}).items():
            stats = models.setdefault(name, ModelStats())
            stats.cross_model_hits = cross.hits
            stats.cross_model_tokens = cross.imported_tokens
        return EngineStats(
            steps=counters.steps,
            decode_steps=counters.decode_steps,
            switches=counters.switches,
            preemptions=counters.preemptions,
            prefill_tokens=counters.prefill_tokens,
            decode_tokens=counters.decode_tokens,
            prefill_tokens_per_step=counters.prefill_tokens / max(1, prefill_steps),
            decode_tokens_per_step=counters.decode_tokens / max(1, counters.decode_steps),
            max_concurrent_decode=monitor.max_concurrent,
            max_concurrent_drafters=monitor.max_concurrent_drafters,
            decode_seconds=decode_seconds,
            switch_overhead=overhead,
            models=models,
            residency=residency,
            speculation=tuple(speculation or ()),
        )


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]
