"""Scheduler, pure policy: hand-written StepResults in, the next StepPlan checked against the rules
in the scheduler's docstring (lifecycle, chunked prefill, abort, leases blocked / failed / retried
and the admission gate, recompute preemption, admission by blocks, max_running), the lane policies
driven through it with switch counting, and a property test: random arrivals over 3-4 models
against a small honest fake engine (loader, runner, block pools, preemption, aborts) checking the
lane invariant, that nothing is lost, and a starvation bound per lane policy.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polylane.policy.scheduling.lane import LANE_POLICIES, LaneMonitor
from polylane.policy.scheduling.scheduler import Scheduler, SchedulerConfig
from polylane.types import PrefillWork, StepPlan, StepResult


def make(*models: str, policy: str = "fcfs", **config: int) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(lane_policy=policy, **config))  # type: ignore[arg-type]
    for model in models:
        scheduler.register_model(model)
    return scheduler


def step(scheduler: Scheduler, **result: object) -> StepPlan:
    """One step: the plan, answered with the given StepResult fields."""
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step, **result))  # type: ignore[arg-type]
    return plan


def lease(scheduler: Scheduler, model: str, free_blocks: int = 1000, block_size: int = 4) -> StepPlan:
    """Let the plan ask for the model's lease, and grant it."""
    plan = step(scheduler)
    assert model in plan.acquire, plan
    scheduler.model_ready(model, free_blocks, block_size)
    return plan


def to_decode(scheduler: Scheduler, *request_ids: int, prompt: int) -> None:
    """Prefill the given requests (all of `prompt` tokens) in one step; each gets its first token."""
    plan = scheduler.schedule()
    assert {w.request_id for w in plan.prefill} == set(request_ids), plan
    scheduler.update(
        plan,
        StepResult(
            plan.step,
            computed=dict.fromkeys(request_ids, prompt),
            tokens=dict.fromkeys(request_ids, 7),
        ),
    )


# ---------------------------------------------------------------------- a request's life


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_step_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_running=0)
    with pytest.raises(ValueError, match="unknown lane policy"):
        Scheduler(SchedulerConfig(lane_policy="nope"))


def test_add_checks_its_input() -> None:
    scheduler = make("a")
    with pytest.raises(ValueError, match="unknown model"):
        scheduler.add(1, "zz", 5)
    with pytest.raises(ValueError):
        scheduler.add(1, "a", 0)
    scheduler.add(5, "a", 3)
    with pytest.raises(ValueError, match="increase"):
        scheduler.add(4, "a", 3)


def test_a_request_life_acquire_chunked_prefill_decode_finish_release() -> None:
    scheduler = make("a", "b", max_step_tokens=8)
    scheduler.add(1, "a", 20)
    plan = step(scheduler)
    assert plan.acquire == ("a",) and not plan.prefill and not plan.decode
    assert scheduler.model_state("a") == "acquiring" and scheduler.model_state("b") == "idle"
    assert scheduler.request_state(1) == "waiting"
    assert step(scheduler).acquire == ()  # asked once, not again while loading

    scheduler.model_ready("a", free_blocks=100, block_size=4)
    # A 20-token prompt under an 8-token budget: 8 + 8 + 4, each `computed` reported back.
    plans = []
    for computed in (8, 16):
        plans.append(step(scheduler, computed={1: computed}))
        assert scheduler.request_state(1) == "prefill"
    plans.append(step(scheduler, computed={1: 20}, tokens={1: 42}))
    assert [p.prefill for p in plans] == [
        (PrefillWork(1, "a", 8),),
        (PrefillWork(1, "a", 8),),
        (PrefillWork(1, "a", 4),),
    ]
    assert not any(p.decode for p in plans)
    assert scheduler.request_state(1) == "decode"
    assert scheduler.counters.prefill_tokens == 20

    # The first token moved it to decode; a second request prefills beside the decode batch,
    # in what the decode leaves of the budget.
    scheduler.add(2, "a", 9)
    plan = step(scheduler, computed={1: 21, 2: 7}, tokens={1: 43})
    assert (plan.decode_model, plan.decode) == ("a", (1,))
    assert plan.prefill == (PrefillWork(2, "a", 7),)
    plan = step(scheduler, computed={1: 22, 2: 9}, tokens={1: 44, 2: 50})
    assert plan.decode == (1,) and plan.prefill == (PrefillWork(2, "a", 2),)
    plan = step(scheduler, computed={1: 23, 2: 10}, tokens={1: 45, 2: 51}, finished={1: "stop"})
    assert (plan.decode_model, plan.decode, plan.prefill) == ("a", (1, 2), ())  # batched together
    assert scheduler.request_state(1) is None  # finished: gone
    plan = step(scheduler, computed={2: 11}, tokens={2: 52}, finished={2: "length"})
    assert plan.decode == (2,) and plan.release == ()
    plan = step(scheduler)
    assert plan.release == ("a",) and not plan.decode  # nothing left: the lease goes back
    assert scheduler.model_state("a") == "idle" and scheduler.num_unfinished() == 0
    assert step(scheduler).is_idle
    counters = scheduler.counters
    assert (counters.decode_steps, counters.decode_tokens, counters.switches) == (4, 5, 0)
    assert counters.lane_steps == {"a": 4}


def test_prefill_continues_from_the_reported_computed_count_and_skips_cached_tokens() -> None:
    scheduler = make("a", max_step_tokens=8)
    scheduler.add(1, "a", 20)
    lease(scheduler, "a")
    # The runner found 8 prompt tokens in the prefix cache: 16 held after the first chunk.
    plan = step(scheduler, computed={1: 16}, cached={1: 8})
    assert plan.prefill == (PrefillWork(1, "a", 8),)
    assert scheduler.schedule().prefill == (PrefillWork(1, "a", 4),)
    assert scheduler.counters.prefill_tokens == 8  # only what was computed


def test_prefill_is_oldest_first_under_the_budget_for_several_models() -> None:
    scheduler = make("a", "b", max_step_tokens=10)
    scheduler.add(1, "a", 6)
    scheduler.add(2, "b", 6)
    scheduler.add(3, "a", 6)
    plan = step(scheduler)
    assert plan.acquire == ("a", "b")
    scheduler.model_ready("a", 100, 4)
    scheduler.model_ready("b", 100, 4)
    plan = scheduler.schedule()  # prefill runs for any leased model, lane owner or not
    assert plan.prefill == (PrefillWork(1, "a", 6), PrefillWork(2, "b", 4))
    assert sum(w.max_tokens for w in plan.prefill) + len(plan.decode) <= 10


def test_decode_batches_every_decode_ready_request_of_the_lane_model_only() -> None:
    scheduler = make("a", "b", policy="fcfs")
    for request_id, model in [(1, "a"), (2, "b"), (3, "a"), (4, "a")]:
        scheduler.add(request_id, model, 4)
    step(scheduler)
    scheduler.model_ready("a", 100, 4)
    scheduler.model_ready("b", 100, 4)
    to_decode(scheduler, 1, 2, 3, 4, prompt=4)
    plan = scheduler.schedule()
    assert plan.decode_model == "a" and plan.decode == (1, 3, 4)
    tokens = dict.fromkeys(plan.decode, 9)
    scheduler.update(plan, StepResult(plan.step, tokens=tokens))
    plan = scheduler.schedule()
    assert plan.decode_model == "b" and plan.decode == (2,)


def test_failed_requests_leave() -> None:
    scheduler = make("a")
    scheduler.add(1, "a", 4)
    scheduler.add(2, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, 2, prompt=4)
    step(scheduler, failed={1: "forward failed"})
    assert scheduler.request_state(1) is None
    assert scheduler.schedule().decode == (2,)


# ---------------------------------------------------------------------- abort


def test_abort_of_a_waiting_request_closes_it_once() -> None:
    scheduler = make("a")
    scheduler.add(1, "a", 4)
    scheduler.add(2, "a", 4)
    assert step(scheduler).acquire == ("a",)
    assert scheduler.abort(1)
    assert not scheduler.abort(1)  # already going
    assert scheduler.has_pending_events()
    plan = step(scheduler)
    assert plan.close == ((1, "abort", ""),)
    assert not scheduler.has_pending_events()
    scheduler.model_ready("a", 100, 4)
    for _ in range(3):
        plan = step(scheduler, computed={2: 4}, tokens={2: 1})
        assert 1 not in plan.decode and all(w.request_id != 1 for w in plan.prefill)
        assert plan.close == ()
    assert scheduler.num_unfinished() == 1


def test_abort_of_a_running_request_appears_in_the_next_close_and_never_again() -> None:
    scheduler = make("a")
    scheduler.add(1, "a", 4)
    scheduler.add(2, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, 2, prompt=4)
    assert scheduler.abort(2, "abort", "client gone")
    plan = step(scheduler, tokens={1: 5})
    assert plan.close == ((2, "abort", "client gone"),)
    assert plan.decode == (1,)
    assert step(scheduler, finished={1: "stop"}).close == ()
    plan = step(scheduler)
    assert plan.release == ("a",) and plan.close == ()
    assert not scheduler.abort(1) and not scheduler.abort(2)


def test_an_unstarted_only_abort_ends_a_queued_request_and_spares_a_begun_one() -> None:
    # (a queue-time bound: a request that never began is refused; one that began keeps running)
    scheduler = make("a", max_step_tokens=4)
    scheduler.add(1, "a", 12)
    scheduler.add(2, "a", 4)
    scheduler.add(3, "a", 4)
    lease(scheduler, "a")
    step(scheduler, computed={1: 4})  # request 1 is in its prefill, 2 and 3 still queued
    assert not scheduler.abort(1, "queue_timeout", unstarted_only=True)
    assert scheduler.abort(3, "queue_timeout", unstarted_only=True)
    plan = step(scheduler, computed={1: 4})
    assert plan.close == ((3, "queue_timeout", ""),)
    assert scheduler.num_unfinished() == 2


def test_abort_of_a_request_in_partial_prefill() -> None:
    scheduler = make("a", max_step_tokens=4)
    scheduler.add(1, "a", 12)
    lease(scheduler, "a")
    step(scheduler, computed={1: 4})
    scheduler.abort(1)
    plan = step(scheduler)
    assert plan.close == ((1, "abort", ""),)
    assert plan.prefill == () and plan.release == ("a",)


# ---------------------------------------------------------------------- leases


def test_model_failed_ends_its_waiting_requests_with_error() -> None:
    scheduler = make("a", "b")
    scheduler.add(1, "a", 4)
    scheduler.add(2, "b", 4)
    scheduler.add(3, "a", 4)
    assert step(scheduler).acquire == ("a", "b")
    scheduler.model_failed("a", "corrupt file")
    assert scheduler.model_state("a") == "idle"
    plan = step(scheduler)
    assert plan.close == ((1, "error", "corrupt file"), (3, "error", "corrupt file"))
    assert scheduler.request_state(2) == "waiting" and scheduler.num_unfinished() == 1
    assert step(scheduler).close == ()
    scheduler.add(4, "a", 4)  # a later request for the model tries again
    assert step(scheduler).acquire == ("a",)


def test_model_blocked_with_no_other_holder_is_a_failure() -> None:
    scheduler = make("a")
    scheduler.add(1, "a", 4)
    step(scheduler)
    scheduler.model_blocked("a", "no room: 3 GiB needed")
    assert scheduler.model_state("a") == "idle"
    plan = step(scheduler)
    assert plan.close == ((1, "error", "no room: 3 GiB needed"),)
    assert plan.acquire == ()


def test_blocked_model_is_retried_after_a_release_and_the_admission_gate_holds() -> None:
    scheduler = make("a", "b", "c", max_running=1)
    scheduler.add(1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    scheduler.add(2, "a", 4)  # before b's request: admitted when a has room
    scheduler.add(3, "b", 4)
    plan = step(scheduler, tokens={1: 9})
    assert plan.acquire == ("b",) and plan.decode == (1,)
    scheduler.model_blocked("b", "no room")  # a holds the room
    assert scheduler.model_state("b") == "blocked"
    scheduler.add(4, "a", 4)  # after b's request: gated
    scheduler.add(5, "c", 4)  # after b's request: gated, not even acquired
    plan = step(scheduler, tokens={1: 9}, finished={1: "length"})
    assert plan.acquire == () and plan.release == ()
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(2, "a", 4),)  # the earlier one is admitted
    assert plan.acquire == () and plan.release == ()
    scheduler.update(plan, StepResult(plan.step, computed={2: 4}, tokens={2: 1}))
    step(scheduler, tokens={2: 1}, finished={2: "stop"})
    assert scheduler.request_state(4) == "waiting"  # gated though a is leased with room
    plan = step(scheduler)
    assert plan.release == ("a",) and plan.prefill == ()  # a drains and gives its lease back
    plan = step(scheduler)
    assert plan.acquire == ("b",)  # retried after the release; a and c still wait
    assert scheduler.model_state("b") == "acquiring"
    for _ in range(3):  # while b is loading again, the gate still holds
        plan = step(scheduler)
        assert plan.acquire == () and plan.prefill == ()
    scheduler.model_ready("b", 100, 4)
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(3, "b", 4),)
    assert plan.acquire == ("a", "c")  # the gate is gone


def test_blocked_model_is_not_retried_before_a_release() -> None:
    scheduler = make("a", "b")
    scheduler.add(1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    scheduler.add(2, "b", 4)
    assert step(scheduler, tokens={1: 1}).acquire == ("b",)
    scheduler.model_blocked("b", "no room")
    for _ in range(5):
        assert step(scheduler, tokens={1: 1}).acquire == ()
    step(scheduler, finished={1: "stop"})
    assert step(scheduler).release == ("a",)
    assert step(scheduler).acquire == ("b",)


def test_a_lease_refused_while_a_release_of_the_same_plan_was_in_flight_is_retried() -> None:
    # The engine starts the plan's loads before the runner gives the plan's releases back, so
    # the load may find the room still taken. That is no failure: the room is free now.
    scheduler = make("a", "b")
    scheduler.add(1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    step(scheduler, finished={1: "stop"})
    scheduler.add(2, "b", 4)
    plan = step(scheduler)
    assert plan.acquire == ("b",) and plan.release == ("a",)
    scheduler.model_blocked("b", "no room (a still leased)")
    plan = step(scheduler)
    assert plan.close == () and plan.acquire == ("b",)
    scheduler.model_ready("b", 100, 4)
    assert step(scheduler).prefill == (PrefillWork(2, "b", 4),)


def test_a_blocked_model_waiting_on_a_load_that_fails_is_retried_then_fails() -> None:
    scheduler = make("a", "b")
    scheduler.add(1, "a", 4)
    scheduler.add(2, "b", 4)
    assert step(scheduler).acquire == ("a", "b")
    scheduler.model_blocked("b", "no room")  # a is loading: it holds the room
    assert scheduler.model_state("b") == "blocked"
    scheduler.model_failed("a", "corrupt")  # ... and gives nothing back
    plan = step(scheduler)
    assert plan.close == ((1, "error", "corrupt"),)
    assert plan.acquire == ("b",)  # b does not wait for a release that will never come
    scheduler.model_blocked("b", "no room")  # nobody holds anything: final
    assert step(scheduler).close == ((2, "error", "no room"),)
    assert scheduler.num_unfinished() == 0


def test_blocked_model_whose_requests_all_left_lifts_the_gate() -> None:
    scheduler = make("a", "b")
    scheduler.add(1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    scheduler.add(2, "b", 4)
    step(scheduler, tokens={1: 1})
    scheduler.model_blocked("b", "no room")
    scheduler.add(3, "a", 4)
    step(scheduler, tokens={1: 1})
    assert scheduler.request_state(3) == "waiting"  # gated
    scheduler.abort(2)
    plan = step(scheduler, tokens={1: 1})
    assert plan.prefill == (PrefillWork(3, "a", 4),)


# ---------------------------------------------------------------------- preemption


def test_preempted_request_goes_back_to_waiting_and_prefills_prompt_plus_generated() -> None:
    scheduler = make("a", max_step_tokens=8)
    scheduler.add(1, "a", 10)
    lease(scheduler, "a")
    step(scheduler, computed={1: 8})
    step(scheduler, computed={1: 10}, tokens={1: 1})  # generated 1
    step(scheduler, computed={1: 11}, tokens={1: 2})  # 2
    step(scheduler, computed={1: 12}, tokens={1: 3})  # 3
    plan = step(scheduler, preempted=[1])
    assert plan.decode == (1,)
    assert scheduler.request_state(1) == "waiting"
    assert scheduler.counters.preemptions == 1
    # Recompute: the prompt and the 3 generated tokens, 13 in all, in chunks under the budget.
    plan = step(scheduler, computed={1: 8})
    assert plan.prefill == (PrefillWork(1, "a", 8),) and plan.decode == ()
    plan = step(scheduler, computed={1: 13}, tokens={1: 4})
    assert plan.prefill == (PrefillWork(1, "a", 5),)
    assert scheduler.request_state(1) == "decode"
    assert scheduler.schedule().decode == (1,)


def test_preempted_request_keeps_its_place_by_arrival() -> None:
    scheduler = make("a", max_running=1)
    scheduler.add(1, "a", 4)
    scheduler.add(2, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    step(scheduler, preempted=[1])
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(1, "a", 5),)  # first in, first again, 2 still waits
    assert scheduler.request_state(2) == "waiting"


def test_preemption_of_a_prefilling_request_restarts_its_prompt() -> None:
    scheduler = make("a", max_step_tokens=4)
    scheduler.add(1, "a", 10)
    lease(scheduler, "a")
    step(scheduler, computed={1: 4})
    step(scheduler, preempted=[1])
    assert scheduler.schedule().prefill == (PrefillWork(1, "a", 4),)
    assert scheduler.request_state(1) == "prefill"


# ---------------------------------------------------------------------- admission


def test_admission_by_block_counts_first_come_first_served() -> None:
    scheduler = make("a", max_step_tokens=1000)
    scheduler.add(1, "a", 15)  # ceil((15 + 1) / 4) = 4 blocks
    scheduler.add(2, "a", 23)  # 6 blocks: not there after 1 took 4 (+1 headroom)
    scheduler.add(3, "a", 3)  # 1 block: there, but 2 came first
    step(scheduler)
    scheduler.model_ready("a", free_blocks=10, block_size=4)
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(1, "a", 15),)
    scheduler.update(plan, StepResult(plan.step, computed={1: 15}, tokens={1: 1}, free_blocks={"a": 6}))
    step(scheduler, finished={1: "stop"}, free_blocks={"a": 10})
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill] == [2, 3]  # 6 (+1), then 1 of the 3 left


@pytest.mark.parametrize(("free", "admitted"), [(4, True), (3, False)])
def test_admission_needs_blocks_for_the_prompt_plus_one(free: int, admitted: bool) -> None:
    scheduler = make("a")
    scheduler.add(1, "a", 12)  # 13 tokens of 4: 4 blocks
    step(scheduler)
    scheduler.model_ready("a", free_blocks=free, block_size=4)
    assert bool(scheduler.schedule().prefill) is admitted
    assert scheduler.request_state(1) == ("prefill" if admitted else "waiting")


def test_admission_keeps_a_block_of_headroom_per_running_request() -> None:
    scheduler = make("a")
    scheduler.add(1, "a", 4)
    scheduler.add(2, "a", 4)
    lease(scheduler, "a", free_blocks=100)
    to_decode(scheduler, 1, 2, prompt=4)
    step(scheduler, tokens={1: 1, 2: 1}, free_blocks={"a": 6})  # 6 - 2 of headroom = 4
    scheduler.add(3, "a", 11)  # 3 blocks
    scheduler.add(4, "a", 12)  # 4 blocks
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill] == [3]  # 4 - (3 + 1) = 0 left for request 4


def test_admission_counts_the_blocks_a_partial_prefill_still_needs() -> None:
    # Request 1 (21 tokens with its first: 6 blocks of 4) has 8 prompt tokens in 2 blocks after
    # one chunk; the pool of 10 reports 8 free, but 4 of those are 1's. Admitting request 2
    # (5 blocks) would over-commit the pool.
    scheduler = make("a", max_step_tokens=8)
    scheduler.add(1, "a", 20)
    lease(scheduler, "a", free_blocks=10)
    step(scheduler, computed={1: 8}, free_blocks={"a": 8})
    scheduler.add(2, "a", 16)
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill] == [1]
    assert scheduler.request_state(2) == "waiting"
    scheduler.update(plan, StepResult(plan.step, computed={1: 16}, free_blocks={"a": 6}))
    plan = step(scheduler, computed={1: 20}, tokens={1: 1}, free_blocks={"a": 5})
    assert scheduler.request_state(2) == "waiting"
    step(scheduler, finished={1: "stop"}, free_blocks={"a": 10})
    assert [w.request_id for w in scheduler.schedule().prefill] == [2]


def test_max_running_caps_admitted_requests_per_model() -> None:
    scheduler = make("a", "b", max_running=2)
    for request_id, model in [(1, "a"), (2, "a"), (3, "a"), (4, "b")]:
        scheduler.add(request_id, model, 4)
    step(scheduler)
    scheduler.model_ready("a", 100, 4)
    scheduler.model_ready("b", 100, 4)
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill] == [1, 2, 4]  # b has its own cap
    prefilled = dict.fromkeys([1, 2, 4], 4)
    scheduler.update(plan, StepResult(plan.step, computed=prefilled, tokens=prefilled))
    assert scheduler.request_state(3) == "waiting"
    plan = step(scheduler, tokens={1: 1, 2: 1}, finished={1: "stop"})
    assert plan.prefill == () and plan.decode == (1, 2)
    assert scheduler.schedule().prefill == (PrefillWork(3, "a", 4),)


# ---------------------------------------------------------------------- the lane, through the scheduler


def run_lanes(scheduler: Scheduler, steps: int) -> list[str | None]:
    """Every planned prefill completes and every decode gets a token (nothing ever finishes)."""
    owners = []
    for _ in range(steps):
        plan = scheduler.schedule()
        owners.append(plan.decode_model)
        ids = [w.request_id for w in plan.prefill] + list(plan.decode)
        scheduler.update(plan, StepResult(plan.step, tokens=dict.fromkeys(ids, 1)))
    return owners


def decoding(scheduler: Scheduler, models: list[str], priorities: dict[str, int] | None = None) -> None:
    """One decode-ready request per model, all in one step."""
    for request_id, model in enumerate(models, start=1):
        scheduler.add(request_id, model, 2, (priorities or {}).get(model, 0))
    step(scheduler)
    for model in models:
        scheduler.model_ready(model, 100, 4)
    to_decode(scheduler, *range(1, len(models) + 1), prompt=2)


def test_fcfs_alternates_and_every_change_counts_as_a_switch() -> None:
    scheduler = make("a", "b", "c", policy="fcfs")
    decoding(scheduler, ["a", "b", "c"])
    assert run_lanes(scheduler, 6) == ["a", "b", "c", "a", "b", "c"]
    assert scheduler.counters.switches == 5
    assert scheduler.counters.lane_steps == {"a": 2, "b": 2, "c": 2}
    assert scheduler.lane_owner == "c"


def test_round_robin_cycles_in_registration_order_through_the_scheduler() -> None:
    scheduler = make("b", "c", "a", policy="round-robin")
    decoding(scheduler, ["a", "b", "c"])  # arrival order is not registration order
    assert run_lanes(scheduler, 6) == ["b", "c", "a", "b", "c", "a"]
    assert scheduler.counters.switches == 5


def test_throughput_keeps_the_lane_for_the_quantum() -> None:
    scheduler = make("a", "b", "c", policy="throughput", quantum=3)
    decoding(scheduler, ["a", "b", "c"])
    assert run_lanes(scheduler, 10) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["a"]
    assert scheduler.counters.switches == 3
    assert scheduler.counters.decode_steps == 10


def test_throughput_switches_early_when_the_owner_runs_dry() -> None:
    scheduler = make("a", "b", policy="throughput", quantum=5)
    decoding(scheduler, ["a", "b"])
    assert step(scheduler, tokens={1: 1}).decode_model == "a"
    assert step(scheduler, finished={1: "stop"}).decode_model == "a"
    assert scheduler.schedule().decode_model == "b"


def test_priority_through_the_scheduler_ages_the_low_priority_model() -> None:
    scheduler = make("a", "b", policy="priority", aging_steps=2)
    decoding(scheduler, ["a", "b"], priorities={"a": 2, "b": 0})
    owners = run_lanes(scheduler, 20)
    assert owners[0] == "a"
    first_b = owners.index("b")
    assert first_b <= (2 + 1) * 2  # gap 2, aging 2
    assert owners.count("a") > owners.count("b") > 0


def test_only_one_model_decodes_and_switches_are_counted_for_a_single_model() -> None:
    scheduler = make("a", policy="throughput", quantum=1)
    decoding(scheduler, ["a"])
    assert run_lanes(scheduler, 5) == ["a"] * 5
    assert scheduler.counters.switches == 0


# ---------------------------------------------------------------------- property: a fake engine


@dataclass
class FakeRequest:
    id: int
    model: str
    prompt_len: int
    max_tokens: int
    priority: int
    kv: int = 0  # tokens of KV held
    blocks: int = 0
    generated: int = 0
    ended: str | None = None


@dataclass
class FakeEngine:
    """Plays the engine, its loader and its runner honestly around the scheduler under test.

    Loader: one load at a time, in order, each taking 0..`load_delay` steps, before or after the
    step's releases (as the real engine races them); a lease is refused for room when `lease_cap`
    models hold one, and fails outright with probability `fail_p`. Runner: one pool of
    `pool_blocks` blocks per leased model; a prefill chunk computes min(asked, what is left) tokens
    and samples the first token at the prompt's end; a step that needs more blocks than are free
    preempts the youngest request (and, with probability `preempt_p`, a random one). Engine: a
    request finishes with "length" at its max_tokens, or "stop" with probability `eos_p`.
    """

    scheduler: Scheduler
    rng: random.Random
    pool_blocks: int
    block_size: int
    lease_cap: int
    load_delay: int = 0
    preempt_p: float = 0.0
    eos_p: float = 0.0
    fail_p: float = 0.0
    requests: dict[int, FakeRequest] = field(default_factory=dict)
    free: dict[str, int] = field(default_factory=dict)  # leased models' free blocks
    loads: list[str] = field(default_factory=list)
    load_wait: int = 0
    inbox: list[tuple[str, str]] = field(default_factory=list)
    monitor: LaneMonitor = field(default_factory=LaneMonitor)
    plans: list[StepPlan] = field(default_factory=list)
    failed_models: set[str] = field(default_factory=set)
    short_chunks: set[int] = field(default_factory=set)  # asked for less than was left, last step

    def submit(self, request_id: int, model: str, prompt_len: int, max_tokens: int, priority: int) -> None:
        assert prompt_len + max_tokens <= self.pool_blocks * self.block_size  # the engine's check
        self.requests[request_id] = FakeRequest(request_id, model, prompt_len, max_tokens, priority)
        self.scheduler.add(request_id, model, prompt_len, priority)

    def abort(self, request_id: int) -> None:
        if self.requests[request_id].ended is None:
            self.scheduler.abort(request_id)

    def step(self) -> tuple[StepPlan, StepResult]:
        for kind, name in self.inbox:  # the loop drains its inbox before each plan
            if kind == "ready":
                self.scheduler.model_ready(name, self.free[name], self.block_size)
            elif kind == "blocked":
                self.scheduler.model_blocked(name, "no room")
            else:
                self.scheduler.model_failed(name, "load failed")
        self.inbox = []
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        self.loads.extend(plan.acquire)
        race = self.rng.random() < 0.5
        if race:
            self._load()
        result = self._execute(plan)
        if not race:
            self._load()
        self._deliver(result)
        self.scheduler.update(plan, result)
        return plan, result

    def _load(self) -> None:
        """Answer the queued acquires in order, until one takes a while (a load from disk)."""
        while self.loads:
            if self.load_wait < self.load_delay and self.rng.random() < 0.5:
                self.load_wait += 1
                return
            self.load_wait = 0
            name = self.loads.pop(0)
            assert name not in self.free, f"{name} acquired while it holds a lease"
            if self.rng.random() < self.fail_p:
                self.failed_models.add(name)
                self.inbox.append(("failed", name))
            elif len(self.free) >= self.lease_cap:
                self.inbox.append(("blocked", name))
            else:
                self.free[name] = self.pool_blocks
                self.inbox.append(("ready", name))

    def _let_go(self, request: FakeRequest) -> None:
        if request.blocks:
            self.free[request.model] += request.blocks
        request.kv = request.blocks = 0

    def _end(self, request: FakeRequest, reason: str) -> None:
        assert request.ended is None, f"request {request.id} ended twice"
        self._let_go(request)
        request.ended = reason

    def _execute(self, plan: StepPlan) -> StepResult:
        result = StepResult(plan.step)
        for request_id, reason, _message in plan.close:
            self._end(self.requests[request_id], reason)
        work: dict[str, list[tuple[FakeRequest, int]]] = {}
        self.short_chunks = set()
        for w in plan.prefill:
            request = self.requests[w.request_id]
            assert w.model == request.model and request.ended is None
            left = request.prompt_len + request.generated - request.kv
            assert 1 <= w.max_tokens <= left, (w, left)
            if w.max_tokens < left:
                self.short_chunks.add(w.request_id)
            work.setdefault(request.model, []).append((request, w.max_tokens))
        for request_id in plan.decode:
            request = self.requests[request_id]
            assert request.ended is None and request.generated >= 1
            assert request.kv == request.prompt_len + request.generated - 1  # prefilled
            work.setdefault(request.model, []).append((request, 1))
        for model, items in work.items():
            assert model in self.free, f"{model} runs without a lease"
            decoding = model == plan.decode_model
            if decoding:
                self.monitor.enter(model)
            if items and self.rng.random() < self.preempt_p:
                victim = self.rng.choice(items)
                items.remove(victim)
                self._preempt(victim[0], result)
            while items:
                need = sum(self._blocks(r.kv + n) - r.blocks for r, n in items)
                if need <= self.free[model]:
                    break
                victim = max(items, key=lambda item: item[0].id)
                items.remove(victim)
                self._preempt(victim[0], result)
            for request, n in items:
                blocks = self._blocks(request.kv + n)
                self.free[model] -= blocks - request.blocks
                request.kv, request.blocks = request.kv + n, blocks
                result.computed[request.id] = request.kv
                if request.kv == request.prompt_len + request.generated:  # prompt done / decoded
                    request.generated += 1
                    result.tokens[request.id] = 1000 + request.generated
            if decoding:
                self.monitor.exit(model)
        for model in plan.release:
            assert model in self.free
            holding = [r.id for r in self.requests.values() if r.model == model and r.blocks]
            assert not holding, f"{model} released while {holding} hold KV"
            assert self.free[model] == self.pool_blocks
            del self.free[model]
        result.free_blocks = dict(self.free)
        return result

    def _preempt(self, request: FakeRequest, result: StepResult) -> None:
        self._let_go(request)
        result.preempted.append(request.id)

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _deliver(self, result: StepResult) -> None:
        for request_id in result.tokens:
            request = self.requests[request_id]
            if request.generated >= request.max_tokens:
                result.finished[request_id] = "length"
            elif self.rng.random() < self.eos_p:
                result.finished[request_id] = "stop"
            else:
                continue
            self._end(request, result.finished[request_id])


def test_a_blocked_model_is_not_starved_by_a_stream_of_requests_for_the_holder() -> None:
    # Room for one lease. m0 is leased and gets a new request every step; m1's one request must
    # still be served once the m0 requests that came before it are done (the admission gate).
    scheduler = Scheduler(SchedulerConfig(lane_policy="throughput", max_step_tokens=64))
    for model in ("m0", "m1"):
        scheduler.register_model(model)
    engine = FakeEngine(scheduler, random.Random(1), pool_blocks=64, block_size=4, lease_cap=1)
    engine.submit(1, "m0", 4, 6, 0)
    for _ in range(3):
        engine.step()
    engine.submit(2, "m0", 4, 6, 0)
    engine.submit(3, "m1", 4, 6, 0)
    for request_id in range(4, 60):
        engine.submit(request_id, "m0", 4, 6, 0)
        engine.step()
        if engine.requests[3].ended:
            break
    assert engine.requests[3].ended == "length"
    assert engine.requests[1].ended == engine.requests[2].ended == "length"
    assert request_id < 30, request_id
    while scheduler.num_unfinished() or engine.free or engine.loads or engine.inbox:
        engine.step()
        assert len(engine.plans) < 500
    assert all(r.ended == "length" for r in engine.requests.values())


def starvation_bound(config: SchedulerConfig, models: int, gap: int) -> int:
    """The most plans in a row a decode-ready request may sit out, from the lane docstring."""
    if config.lane_policy == "throughput":
        return config.quantum * (models - 1)
    if config.lane_policy == "priority":
        return (gap + 1) * config.aging_steps + models - 2
    return models - 1  # fcfs, round-robin: every other model at most once


@st.composite
def workloads(draw: st.DrawFn, policy: str) -> dict:
    num_models = draw(st.integers(3, 4))
    block_size = draw(st.sampled_from([2, 4]))
    requests = []
    for _ in range(draw(st.integers(1, 24))):
        requests.append(
            (
                draw(st.integers(0, 40)),  # arrival step
                draw(st.integers(0, num_models - 1)),
                draw(st.integers(1, 40)),  # prompt
                draw(st.integers(1, 12)),  # max tokens
                draw(st.integers(0, 2)),  # priority
                draw(st.none() | st.integers(0, 20)),  # abort this many steps after arrival
            )
        )
    requests.sort(key=lambda r: r[0])
    return {
        "models": [f"m{i}" for i in range(num_models)],
        "config": SchedulerConfig(
            max_step_tokens=draw(st.sampled_from([4, 16, 64])),
            max_running=draw(st.sampled_from([1, 2, 8])),
            lane_policy=policy,
            quantum=draw(st.integers(1, 4)),
            aging_steps=draw(st.integers(1, 4)),
        ),
        "block_size": block_size,
        "pool_blocks": math.ceil(52 / block_size) + draw(st.integers(0, 12)),
        "lease_cap": draw(st.integers(1, 3)),
        "load_delay": draw(st.integers(0, 3)),
        "preempt_p": draw(st.sampled_from([0.0, 0.05])),
        "eos_p": draw(st.sampled_from([0.0, 0.1])),
        "fail_p": draw(st.sampled_from([0.0, 0.0, 0.15])),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "requests": requests,
    }


def run_workload(w: dict) -> tuple[int, int]:
    """Run it, checking every plan; returns (longest decode wait seen, its bound)."""
    config: SchedulerConfig = w["config"]
    scheduler = Scheduler(config)
    for model in w["models"]:
        scheduler.register_model(model)
    engine = FakeEngine(
        scheduler,
        random.Random(w["seed"]),
        w["pool_blocks"],
        w["block_size"],
        w["lease_cap"],
        w["load_delay"],
        w["preempt_p"],
        w["eos_p"],
        w["fail_p"],
    )
    arrivals = list(enumerate(w["requests"], start=1))
    priorities = [r[4] for r in w["requests"]]
    bound = starvation_bound(config, len(w["models"]), max(priorities) - min(priorities))
    aborts: dict[int, list[int]] = {}
    closed: set[int] = set()
    sat_out: dict[int, int] = {}  # decode-ready request → plans in a row without a token
    worst = 0
    for now in range(3000):
        while arrivals and arrivals[0][1][0] <= now:
            request_id, (_, model, prompt, max_tokens, priority, abort_after) = arrivals.pop(0)
            engine.submit(request_id, f"m{model}", prompt, max_tokens, priority)
            if abort_after is not None:
                aborts.setdefault(now + abort_after, []).append(request_id)
        for request_id in aborts.pop(now, []):
            engine.abort(request_id)
        settled = not (engine.free or engine.loads or engine.inbox or scheduler.has_pending_events())
        if not arrivals and not aborts and scheduler.num_unfinished() == 0 and settled:
            break
        ready = {r for r in engine.requests if scheduler.request_state(r) == "decode"}
        plan, _ = engine.step()

        # The lane: one model decodes, every one of its decode-ready requests with it.
        decode_models = {engine.requests[r].model for r in plan.decode}
        assert decode_models <= {plan.decode_model}, plan
        if plan.decode_model is not None:
            mine = {r for r in ready if engine.requests[r].model == plan.decode_model}
            assert mine == set(plan.decode), (plan, mine)
        # No request twice, nothing after it ended, and within the step budget.
        ids = [w.request_id for w in plan.prefill] + list(plan.decode) + [c[0] for c in plan.close]
        assert len(ids) == len(set(ids)), plan
        assert not closed & set(ids), plan
        closed |= {c[0] for c in plan.close}
        prefill_tokens = sum(work.max_tokens for work in plan.prefill)
        assert prefill_tokens <= max(0, config.max_step_tokens - len(plan.decode)), plan
        # A chunk is short of what its request has left only where the budget ran out.
        short = [work for work in plan.prefill if work.request_id in engine.short_chunks]
        assert len(short) <= 1 and (not short or short[0] == plan.prefill[-1]), plan
        if short:
            assert prefill_tokens + len(plan.decode) == config.max_step_tokens, plan
        # At most max_running requests of a model are admitted at once.
        for model in w["models"]:
            admitted = [
                r
                for r, request in engine.requests.items()
                if request.model == model and scheduler.request_state(r) in ("prefill", "decode")
            ]
            assert len(admitted) <= config.max_running, (model, admitted)
        # No starvation: a decode-ready request decodes within the policy's bound.
        sat_out = {r: sat_out.get(r, 0) + 1 for r in ready if r not in plan.decode}
        worst = max(worst, *sat_out.values(), 0)
        assert worst <= bound, (config.lane_policy, worst, bound, sat_out)
    else:
        pytest.fail(f"not done after 3000 steps: {scheduler.num_unfinished()} unfinished")

    # Nothing lost: every request ended once, through close or finished, for a reason that fits.
    for request in engine.requests.values():
        assert request.ended is not None, request
        if request.ended == "error":
            assert request.model in engine.failed_models, request
        elif request.ended == "length":
            assert request.generated == request.max_tokens, request
        else:
            assert request.ended in ("stop", "abort"), request
    assert engine.monitor.max_concurrent == (1 if any(p.decode for p in engine.plans) else 0)
    assert scheduler.counters.decode_steps == sum(1 for p in engine.plans if p.decode)
    assert all(scheduler.model_state(m) == "idle" for m in w["models"])
    return worst, bound


@pytest.mark.parametrize("policy", LANE_POLICIES)
def test_random_workloads_lose_nothing_and_starve_nobody(policy: str) -> None:
    @settings(max_examples=120, deadline=None)
    @given(workloads(policy))
    def check(w: dict) -> None:
        run_workload(w)

    check()
