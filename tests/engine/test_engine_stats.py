"""Engine statistics without a model: the switch overhead compares like with like."""

from __future__ import annotations

import pytest

from polylane.engine_stats import StatsRecorder
from polylane.policy.scheduling.lane import LaneMonitor
from polylane.policy.scheduling.scheduler import SchedulerCounters
from polylane.types import PrefillWork, StepPlan, StepResult


def _decode(recorder: StatsRecorder, model: str, batch: int, seconds: float, prefill: bool = False) -> None:
    plan = StepPlan(
        step=0,
        prefill=(PrefillWork(999, model, 16),) if prefill else (),
        decode_model=model,
        decode=tuple(range(batch)),
    )
    recorder.step(plan, StepResult(step=0), seconds)


def _overhead(recorder: StatsRecorder) -> float:
    return recorder.snapshot(SchedulerCounters(), LaneMonitor(), None, {}).switch_overhead


def test_switch_overhead_compares_steps_of_the_same_model_and_batch():
    recorder = StatsRecorder()
    # a fast model and a slow one alternate; each switch step costs 10 ms more than its steady steps
    _decode(recorder, "slow", 1, 0.100)  # the first decode step is no switch
    for _ in range(4):
        _decode(recorder, "fast", 2, 0.030)  # switch
        _decode(recorder, "fast", 2, 0.020)
        _decode(recorder, "slow", 1, 0.110)  # switch
        _decode(recorder, "slow", 1, 0.100)
    # 8 switch steps × 10 ms over 0.1 + 4 × 0.26 s of decode time
    assert _overhead(recorder) == pytest.approx(8 * 0.010 / (0.1 + 4 * 0.26))


def test_no_switch_cost_when_switch_steps_take_what_steady_steps_take():
    recorder = StatsRecorder()
    for _ in range(5):
        _decode(recorder, "fast", 1, 0.020)
        _decode(recorder, "fast", 1, 0.020)
        _decode(recorder, "slow", 1, 0.100)
        _decode(recorder, "slow", 1, 0.100)
    # per-token means of all switch steps against all steady steps would mix the two models' costs
    assert _overhead(recorder) == pytest.approx(0.0, abs=1e-12)


def test_steps_that_also_prefill_are_left_out_of_the_comparison():
    recorder = StatsRecorder()
    _decode(recorder, "a", 1, 0.020)
    _decode(recorder, "a", 1, 0.020)
    _decode(recorder, "b", 1, 0.500, prefill=True)  # a switch step slowed by a prefill chunk
    _decode(recorder, "b", 1, 0.020)
    _decode(recorder, "a", 1, 0.020)
    assert _overhead(recorder) == pytest.approx(0.0, abs=1e-12)
