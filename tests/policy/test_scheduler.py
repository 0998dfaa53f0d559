"""Scheduler, pure policy: hand-written StepResults in, the next StepPlan checked against the rules
in the scheduler's docstring — a request's life, chunked prefill, abort, leases blocked / failed /
retried and the admission gate, max_running — and the KV blocks it now owns through each model's
`KVManager`: admission by blocks with headroom (cached prefixes count as room), prefix-cache hits
and their copy-on-write, preemption decided at schedule time (recompute from the cached prefix),
lookahead slots for a verify pass and their rollback, and abort / failure letting blocks go
uncached. The lane policies are driven through it with switch counting. A property test runs random
arrivals over 3-4 models against a small honest fake engine (loader; runner writing token ids into
the blocks the plans name, accepting random drafts of a lookahead, failing a request now and then;
random finishes and aborts) checking the lane invariant, that nothing is lost, a starvation bound
per lane policy, that every request of a plan has the room its work needs and reads back its own
tokens, and that KV blocks are conserved after every step.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from polylane.policy.kv.manager import KVManager
from polylane.policy.scheduling.lane import LANE_POLICIES, LaneMonitor
from polylane.policy.scheduling.scheduler import Scheduler, SchedulerConfig
from polylane.types import BlockTable, PrefillWork, StepPlan, StepResult

B = 4  # block size of the hand cases


def table_of(plan: StepPlan, request_id: int) -> BlockTable:
    return next(t for t in plan.tables if t.request_id == request_id)


def all_written(plan: StepPlan) -> dict[int, int]:
    """What the runner reports after doing the whole plan: every prefill chunk and one decode
    token of KV written."""
    computed = {w.request_id: table_of(plan, w.request_id).num_tokens + w.max_tokens for w in plan.prefill}
    computed.update({r: table_of(plan, r).num_tokens + 1 for r in plan.decode})
    return computed


def make(*models: str, policy: str = "fcfs", **config: int) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(lane_policy=policy, **config))  # type: ignore[arg-type]
    for model in models:
        scheduler.register_model(model)
    return scheduler


def ids(request_id: int, length: int) -> list[int]:
    """A prompt of `length` token ids no other request's prompt shares (no prefix-cache hits)."""
    return [request_id * 1000 + i for i in range(length)]


def add(scheduler: Scheduler, request_id: int, model: str, length: int, priority: int = 0) -> None:
    scheduler.add(request_id, model, ids(request_id, length), priority)


def step(scheduler: Scheduler, finish: Iterable[int] = (), **result: object) -> StepPlan:
    """One step: the plan, answered with the given StepResult fields, then `finish` of each of
    `finish` (the engine's output check). A decode request given a token without a `computed`
    entry is reported as having written one more token of KV (a plain decode)."""
    plan = scheduler.schedule()
    computed = dict(result.pop("computed", {}))  # type: ignore[call-overload]
    for request_id in plan.decode:
        if request_id in result.get("tokens", {}) and request_id not in computed:  # type: ignore[operator]
            computed[request_id] = table_of(plan, request_id).num_tokens + 1
    scheduler.update(plan, StepResult(plan.step, computed=computed, **result))  # type: ignore[arg-type]
    for request_id in finish:
        scheduler.finish(request_id)
    return plan


def lease(scheduler: Scheduler, model: str, num_blocks: int = 1000, lookahead: int = 0) -> KVManager:
    """Let the plan ask for the model's lease, and grant it with a fresh KVManager of blocks of B."""
    plan = step(scheduler)
    assert model in plan.acquire, plan
    kv = KVManager(num_blocks, B)
    scheduler.model_ready(model, kv, lookahead)
    return kv


def to_decode(scheduler: Scheduler, *request_ids: int, prompt: int) -> StepPlan:
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
    return plan


def room(table: BlockTable) -> int:
    """Slots the table holds past the tokens written: what the step may write."""
    return len(table.blocks) * B - table.num_tokens


def conserved(kv: KVManager, *holders: int) -> None:
    """Every block is free, or held once per holder's table and once by the prefix tree."""
    owners = Counter(block for holder in holders for block in kv.table(holder))
    owners.update(kv.tree.held_blocks())
    for block in range(kv.pool.num_blocks):
        assert kv.pool.ref_count(block) == owners[block], (block, owners)
    assert kv.pool.num_free == sum(1 for block in range(kv.pool.num_blocks) if not owners[block])
    kv.tree.validate()


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
        scheduler.add(1, "zz", [1, 2])
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add(1, "a", [])
    scheduler.add(5, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="increase"):
        scheduler.add(4, "a", [1, 2, 3])


def test_lookahead_is_checked() -> None:
    scheduler = make("a")
    with pytest.raises(ValueError, match="lookahead"):
        scheduler.set_lookahead("a", -1)


def test_a_request_life_acquire_chunked_prefill_decode_finish_release() -> None:
    scheduler = make("a", "b", max_step_tokens=8)
    add(scheduler, 1, "a", 20)
    plan = step(scheduler)
    assert plan.acquire == ("a",) and not plan.prefill and not plan.decode and not plan.tables
    assert scheduler.model_state("a") == "acquiring" and scheduler.model_state("b") == "idle"
    assert scheduler.request_state(1) == "waiting"
    assert step(scheduler).acquire == ()  # asked once, not again while loading

    kv = KVManager(100, B)
    scheduler.model_ready("a", kv)
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
    # Admission took the whole prompt's blocks at once; `cached` (no hit) only on that step.
    blocks = table_of(plans[0], 1).blocks
    assert plans[0].tables == (BlockTable(1, blocks, 0, (), 0),) and len(blocks) == 5
    assert [table_of(p, 1) for p in plans[1:]] == [BlockTable(1, blocks, 8), BlockTable(1, blocks, 16)]
    assert not any(p.decode for p in plans)
    assert scheduler.request_state(1) == "decode"
    assert scheduler.counters.prefill_tokens == 20
    assert (kv.table(1), kv.num_tokens(1), kv.pool.num_free) == (blocks, 20, 95)

    # The first token moved it to decode; a second request prefills beside the decode batch,
    # in what the decode leaves of the budget.
    add(scheduler, 2, "a", 9)
    plan = step(scheduler, computed={1: 21, 2: 7}, tokens={1: 43})
    assert (plan.decode_model, plan.decode) == ("a", (1,))
    assert plan.prefill == (PrefillWork(2, "a", 7),)
    assert room(table_of(plan, 1)) >= 1 and table_of(plan, 2).cached == 0 and room(table_of(plan, 2)) >= 7
    plan = step(scheduler, computed={1: 22, 2: 9}, tokens={1: 44, 2: 50})
    assert plan.decode == (1,) and plan.prefill == (PrefillWork(2, "a", 2),)
    plan = step(scheduler, computed={1: 23, 2: 10}, tokens={1: 45, 2: 51}, finish=[1])
    assert (plan.decode_model, plan.decode, plan.prefill) == ("a", (1, 2), ())  # batched together
    assert scheduler.request_state(1) is None  # finished: gone
    assert not kv.holds(1) and kv.tree.num_cached_blocks == 5  # its 23 written tokens: 5 blocks
    plan = step(scheduler, computed={2: 11}, tokens={2: 52}, finish=[2])
    assert plan.decode == (2,) and plan.release == ()
    plan = step(scheduler)
    assert plan.release == ("a",) and not plan.decode  # nothing left: the lease goes back
    assert scheduler.model_state("a") == "idle" and scheduler.num_unfinished() == 0
    assert kv.tree.num_cached_blocks == 7 and kv.pool.num_free == 93  # 2's 11 tokens: 2 more
    conserved(kv)
    assert step(scheduler).is_idle
    counters = scheduler.counters
    assert (counters.decode_steps, counters.decode_tokens, counters.switches) == (4, 5, 0)
    assert counters.lane_steps == {"a": 4}


def test_prefill_continues_from_the_reported_computed_count() -> None:
    # The runner imported 8 more prompt tokens (another model's KV): 16 held after an 8-token chunk.
    scheduler = make("a", max_step_tokens=8)
    add(scheduler, 1, "a", 20)
    kv = lease(scheduler, "a")
    plan = step(scheduler, computed={1: 16})
    assert plan.prefill == (PrefillWork(1, "a", 8),)
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(1, "a", 4),)
    assert table_of(plan, 1).num_tokens == kv.num_tokens(1) == 16 and room(table_of(plan, 1)) == 4


def test_prefill_is_oldest_first_under_the_budget_for_several_models() -> None:
    scheduler = make("a", "b", max_step_tokens=10)
    add(scheduler, 1, "a", 6)
    add(scheduler, 2, "b", 6)
    add(scheduler, 3, "a", 6)
    plan = step(scheduler)
    assert plan.acquire == ("a", "b")
    scheduler.model_ready("a", KVManager(100, B))
    scheduler.model_ready("b", KVManager(100, B))
    plan = scheduler.schedule()  # prefill runs for any leased model, lane owner or not
    assert plan.prefill == (PrefillWork(1, "a", 6), PrefillWork(2, "b", 4))
    assert sum(w.max_tokens for w in plan.prefill) + len(plan.decode) <= 10
    assert {t.request_id for t in plan.tables} == {1, 2}


def test_decode_batches_every_decode_ready_request_of_the_lane_model_only() -> None:
    scheduler = make("a", "b", policy="fcfs")
    for request_id, model in [(1, "a"), (2, "b"), (3, "a"), (4, "a")]:
        add(scheduler, request_id, model, 4)
    step(scheduler)
    scheduler.model_ready("a", KVManager(100, B))
    scheduler.model_ready("b", KVManager(100, B))
    to_decode(scheduler, 1, 2, 3, 4, prompt=4)
    plan = scheduler.schedule()
    assert plan.decode_model == "a" and plan.decode == (1, 3, 4)
    assert all(room(table_of(plan, r)) >= 1 for r in plan.decode)
    scheduler.update(
        plan,
        StepResult(plan.step, computed=dict.fromkeys(plan.decode, 5), tokens=dict.fromkeys(plan.decode, 9)),
    )
    plan = scheduler.schedule()
    assert plan.decode_model == "b" and plan.decode == (2,)


def test_failed_requests_leave_and_their_blocks_go_back_uncached() -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 8)
    add(scheduler, 2, "a", 8)
    kv = lease(scheduler, "a", num_blocks=10)
    to_decode(scheduler, 1, 2, prompt=8)
    plan = step(scheduler, computed={2: 9}, tokens={2: 1}, failed={1: "forward failed"})
    assert plan.decode == (1, 2)
    assert scheduler.request_state(1) is None and not kv.holds(1)
    assert kv.tree.num_cached_blocks == 0  # a failed request's KV never enters the cache
    conserved(kv, 2)
    assert kv.pool.num_free == 10 - 3
    assert scheduler.schedule().decode == (2,)


# ---------------------------------------------------------------------- abort


def test_abort_of_a_waiting_request_closes_it_once() -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 4)
    add(scheduler, 2, "a", 4)
    assert step(scheduler).acquire == ("a",)
    assert scheduler.abort(1)
    assert not scheduler.abort(1)  # already going
    assert scheduler.has_pending_events()
    plan = step(scheduler)
    assert plan.close == ((1, "abort", ""),)
    assert not scheduler.has_pending_events()
    scheduler.model_ready("a", KVManager(100, B))
    for _ in range(3):
        plan = step(scheduler, computed={2: 4}, tokens={2: 1})
        assert 1 not in plan.decode and all(w.request_id != 1 for w in plan.prefill)
        assert plan.close == ()
    assert scheduler.num_unfinished() == 1


def test_abort_of_a_running_request_frees_its_blocks_uncached_and_closes_it_once() -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 8)
    add(scheduler, 2, "a", 8)
    kv = lease(scheduler, "a", num_blocks=20)
    to_decode(scheduler, 1, 2, prompt=8)
    step(scheduler, tokens={1: 5, 2: 5})  # both decoded a token: 3 blocks each
    assert kv.pool.num_free == 14
    assert scheduler.abort(2, "abort", "client gone")
    assert not kv.holds(2) and kv.pool.num_free == 17  # let go at once, not at the next step
    assert kv.tree.num_cached_blocks == 0
    conserved(kv, 1)
    plan = step(scheduler, tokens={1: 5})
    assert plan.close == ((2, "abort", "client gone"),)
    assert plan.decode == (1,) and {t.request_id for t in plan.tables} == {1}
    assert step(scheduler, tokens={1: 5}, finish=[1]).close == ()
    plan = step(scheduler)
    assert plan.release == ("a",) and plan.close == ()
    assert not scheduler.abort(1) and not scheduler.abort(2)
    assert kv.tree.num_cached_blocks == 2  # only the finished request's written blocks
    conserved(kv)


def test_an_unstarted_only_abort_ends_a_queued_request_and_spares_a_begun_one() -> None:
    # (a queue-time bound: a request that never began is refused; one that began keeps running)
    scheduler = make("a", max_step_tokens=4)
    add(scheduler, 1, "a", 12)
    add(scheduler, 2, "a", 4)
    add(scheduler, 3, "a", 4)
    lease(scheduler, "a")
    step(scheduler, computed={1: 4})  # request 1 is in its prefill, 2 and 3 still queued
    assert not scheduler.abort(1, "queue_timeout", unstarted_only=True)
    assert scheduler.abort(3, "queue_timeout", unstarted_only=True)
    plan = step(scheduler, computed={1: 8})
    assert plan.close == ((3, "queue_timeout", ""),)
    assert scheduler.num_unfinished() == 2


def test_abort_of_a_request_in_partial_prefill_frees_its_whole_prompt_reservation() -> None:
    scheduler = make("a", max_step_tokens=4)
    add(scheduler, 1, "a", 12)
    kv = lease(scheduler, "a", num_blocks=10)
    step(scheduler, computed={1: 4})
    assert len(kv.table(1)) == 3 and kv.pool.num_free == 7  # the whole prompt, 4 tokens written
    scheduler.abort(1)
    assert kv.pool.num_free == 10 and kv.tree.num_cached_blocks == 0
    plan = step(scheduler)
    assert plan.close == ((1, "abort", ""),)
    assert plan.prefill == () and plan.release == ("a",)


# ---------------------------------------------------------------------- leases


def test_model_failed_ends_its_waiting_requests_with_error() -> None:
    scheduler = make("a", "b")
    add(scheduler, 1, "a", 4)
    add(scheduler, 2, "b", 4)
    add(scheduler, 3, "a", 4)
    assert step(scheduler).acquire == ("a", "b")
    scheduler.model_failed("a", "corrupt file")
    assert scheduler.model_state("a") == "idle"
    plan = step(scheduler)
    assert plan.close == ((1, "error", "corrupt file"), (3, "error", "corrupt file"))
    assert scheduler.request_state(2) == "waiting" and scheduler.num_unfinished() == 1
    assert step(scheduler).close == ()
    add(scheduler, 4, "a", 4)  # a later request for the model tries again
    assert step(scheduler).acquire == ("a",)


def test_model_blocked_with_no_other_holder_is_a_failure() -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 4)
    step(scheduler)
    scheduler.model_blocked("a", "no room: 3 GiB needed")
    assert scheduler.model_state("a") == "idle"
    plan = step(scheduler)
    assert plan.close == ((1, "error", "no room: 3 GiB needed"),)
    assert plan.acquire == ()


def test_blocked_model_is_retried_after_a_release_and_the_admission_gate_holds() -> None:
    scheduler = make("a", "b", "c", max_running=1)
    add(scheduler, 1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    add(scheduler, 2, "a", 4)  # before b's request: admitted when a has room
    add(scheduler, 3, "b", 4)
    plan = step(scheduler, tokens={1: 9})
    assert plan.acquire == ("b",) and plan.decode == (1,)
    scheduler.model_blocked("b", "no room")  # a holds the room
    assert scheduler.model_state("b") == "blocked"
    add(scheduler, 4, "a", 4)  # after b's request: gated
    add(scheduler, 5, "c", 4)  # after b's request: gated, not even acquired
    plan = step(scheduler, tokens={1: 9}, finish=[1])
    assert plan.acquire == () and plan.release == ()
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(2, "a", 4),)  # the earlier one is admitted
    assert plan.acquire == () and plan.release == ()
    scheduler.update(plan, StepResult(plan.step, computed={2: 4}, tokens={2: 1}))
    step(scheduler, tokens={2: 1}, finish=[2])
    assert scheduler.request_state(4) == "waiting"  # gated though a is leased with room
    plan = step(scheduler)
    assert plan.release == ("a",) and plan.prefill == ()  # a drains and gives its lease back
    plan = step(scheduler)
    assert plan.acquire == ("b",)  # retried after the release; a and c still wait
    assert scheduler.model_state("b") == "acquiring"
    for _ in range(3):  # while b is loading again, the gate still holds
        plan = step(scheduler)
        assert plan.acquire == () and plan.prefill == ()
    scheduler.model_ready("b", KVManager(100, B))
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(3, "b", 4),)
    assert plan.acquire == ("a", "c")  # the gate is gone


def test_blocked_model_is_not_retried_before_a_release() -> None:
    scheduler = make("a", "b")
    add(scheduler, 1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    add(scheduler, 2, "b", 4)
    assert step(scheduler, tokens={1: 1}).acquire == ("b",)
    scheduler.model_blocked("b", "no room")
    for _ in range(5):
        assert step(scheduler, tokens={1: 1}).acquire == ()
    step(scheduler, tokens={1: 1}, finish=[1])
    assert step(scheduler).release == ("a",)
    assert step(scheduler).acquire == ("b",)


def test_a_lease_refused_while_a_release_of_the_same_plan_was_in_flight_is_retried() -> None:
    # The engine starts the plan's loads before the runner gives the plan's releases back, so
    # the load may find the room still taken. That is no failure: the room is free now.
    scheduler = make("a", "b")
    add(scheduler, 1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    step(scheduler, tokens={1: 1}, finish=[1])
    add(scheduler, 2, "b", 4)
    plan = step(scheduler)
    assert plan.acquire == ("b",) and plan.release == ("a",)
    scheduler.model_blocked("b", "no room (a still leased)")
    plan = step(scheduler)
    assert plan.close == () and plan.acquire == ("b",)
    scheduler.model_ready("b", KVManager(100, B))
    assert step(scheduler).prefill == (PrefillWork(2, "b", 4),)


def test_a_blocked_model_waiting_on_a_load_that_fails_is_retried_then_fails() -> None:
    scheduler = make("a", "b")
    add(scheduler, 1, "a", 4)
    add(scheduler, 2, "b", 4)
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
    add(scheduler, 1, "a", 4)
    lease(scheduler, "a")
    to_decode(scheduler, 1, prompt=4)
    add(scheduler, 2, "b", 4)
    step(scheduler, tokens={1: 1})
    scheduler.model_blocked("b", "no room")
    add(scheduler, 3, "a", 4)
    step(scheduler, tokens={1: 1})
    assert scheduler.request_state(3) == "waiting"  # gated
    scheduler.abort(2)
    plan = step(scheduler, tokens={1: 1})
    assert plan.prefill == (PrefillWork(3, "a", 4),)


# ---------------------------------------------------------------------- admission by blocks


def test_admission_by_blocks_first_come_first_served_and_cached_blocks_count_as_room() -> None:
    scheduler = make("a", max_step_tokens=1000)
    add(scheduler, 1, "a", 15)  # 4 blocks, +1 of headroom
    add(scheduler, 2, "a", 23)  # 6 blocks, +2: not there after 1 took 4 of the 9
    add(scheduler, 3, "a", 3)  # 1 block, +2: there, but 2 came first
    step(scheduler)
    kv = KVManager(9, B)
    scheduler.model_ready("a", kv)
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(1, "a", 15),)
    assert scheduler.request_state(2) == scheduler.request_state(3) == "waiting"
    assert kv.pool.num_free == 5  # the refusals took nothing
    scheduler.update(plan, StepResult(plan.step, computed={1: 15}, tokens={1: 1}))
    step(scheduler, tokens={1: 2}, finish=[1])  # 16 written: 4 blocks cached, none free
    assert (kv.pool.num_free, kv.tree.num_cached_blocks) == (5, 4)
    plan = scheduler.schedule()
    # 2 takes 6 (+1): the 5 free blocks and one evicted; 3 takes 1 (+2) of the 3 still cached.
    assert [w.request_id for w in plan.prefill] == [2, 3]
    assert (kv.pool.num_free, kv.tree.num_cached_blocks) == (0, 2)
    assert [len(t.blocks) for t in plan.tables] == [6, 1]
    conserved(kv, 2, 3)


@pytest.mark.parametrize(("num_blocks", "admitted"), [(4, True), (3, False)])
def test_admission_needs_blocks_for_the_prompt_plus_a_block_of_headroom(
    num_blocks: int, admitted: bool
) -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 12)  # 3 blocks; its first decode token opens a fourth
    step(scheduler)
    kv = KVManager(num_blocks, B)
    scheduler.model_ready("a", kv)
    assert bool(scheduler.schedule().prefill) is admitted
    assert scheduler.request_state(1) == ("prefill" if admitted else "waiting")
    assert kv.pool.num_free == num_blocks - (3 if admitted else 0)


def test_admission_keeps_a_block_of_headroom_per_running_request() -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 4)
    add(scheduler, 2, "a", 4)
    kv = lease(scheduler, "a", num_blocks=10)
    to_decode(scheduler, 1, 2, prompt=4)
    step(scheduler, tokens={1: 1, 2: 1})  # each holds 2 blocks: 6 free
    assert kv.pool.num_free == 6
    add(scheduler, 3, "a", 11)  # 3 blocks + 3 of headroom (1, 2 and itself) = 6
    add(scheduler, 4, "a", 1)  # 1 block + 4 of headroom: not in the 3 left
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill] == [3]
    assert scheduler.request_state(4) == "waiting" and kv.pool.num_free == 3


def test_admission_takes_the_whole_prompt_so_a_chunked_prefill_never_runs_short() -> None:
    # Request 1 (20 tokens: 5 blocks of 4) is admitted with all of them, though its first chunk
    # writes 8; request 2 (16 tokens: 4 blocks, +2) does not fit the 5 left until 1 is gone.
    scheduler = make("a", max_step_tokens=8)
    add(scheduler, 1, "a", 20)
    kv = lease(scheduler, "a", num_blocks=10)
    plan = step(scheduler, computed={1: 8})
    assert len(table_of(plan, 1).blocks) == 5 and kv.pool.num_free == 5
    add(scheduler, 2, "a", 16)
    for computed, tokens in ((16, {}), (20, {1: 1})):
        plan = scheduler.schedule()
        assert [w.request_id for w in plan.prefill] == [1]
        assert room(table_of(plan, 1)) >= plan.prefill[0].max_tokens
        assert scheduler.request_state(2) == "waiting" and kv.pool.num_free == 5
        scheduler.update(plan, StepResult(plan.step, computed={1: computed}, tokens=tokens))
    step(scheduler, tokens={1: 2}, finish=[1])
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill] == [2]
    conserved(kv, 2)


def test_max_running_caps_admitted_requests_per_model() -> None:
    scheduler = make("a", "b", max_running=2)
    for request_id, model in [(1, "a"), (2, "a"), (3, "a"), (4, "b")]:
        add(scheduler, request_id, model, 4)
    step(scheduler)
    kv = KVManager(100, B)
    scheduler.model_ready("a", kv)
    scheduler.model_ready("b", KVManager(100, B))
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill] == [1, 2, 4]  # b has its own cap
    prefilled = dict.fromkeys([1, 2, 4], 4)
    scheduler.update(plan, StepResult(plan.step, computed=prefilled, tokens=prefilled))
    assert scheduler.request_state(3) == "waiting" and not kv.holds(3)
    plan = step(scheduler, tokens={1: 1, 2: 1}, finish=[1])
    assert plan.prefill == () and plan.decode == (1, 2)
    assert scheduler.schedule().prefill == (PrefillWork(3, "a", 4),)


# ---------------------------------------------------------------------- the prefix cache


def cached(prompt: list[int], decoded: int, num_blocks: int = 20) -> tuple[Scheduler, KVManager]:
    """Model "a" leased with `num_blocks` blocks, where request 1 ran `prompt` to its first token,
    decoded `decoded` more and finished: its written KV is in the prefix tree. Add the next request
    before the next plan, or the lease goes back."""
    scheduler = make("a")
    scheduler.add(1, "a", prompt)
    kv = lease(scheduler, "a", num_blocks)
    plan = step(scheduler, computed={1: len(prompt)}, tokens={1: 1}, finish=[] if decoded else [1])
    assert plan.prefill == (PrefillWork(1, "a", len(prompt)),)
    for token in range(decoded):
        step(scheduler, tokens={1: 2 + token}, finish=[1] if token == decoded - 1 else [])
    assert not kv.holds(1)  # gone: what it wrote is the tree's now
    return scheduler, kv


def test_a_prefix_cache_hit_starts_the_prefill_at_the_hit_with_fewer_new_blocks() -> None:
    prompt = ids(1, 12)
    scheduler, kv = cached(prompt, decoded=2)  # 14 written: 3 whole blocks cached
    cached_blocks = kv.tree.held_blocks()
    assert len(cached_blocks) == 3 and kv.pool.num_free == 17

    scheduler.add(2, "a", [*prompt, 5, 6, 7, 8])  # 16 tokens, the first 12 cached
    plan = scheduler.schedule()
    table = table_of(plan, 2)
    assert table.cached == table.num_tokens == 12 and table.copies == ()
    assert set(table.blocks[:3]) == cached_blocks and len(table.blocks) == 4
    assert plan.prefill == (PrefillWork(2, "a", 4),)  # 16 - 12
    assert kv.pool.num_free == 16  # one new block
    scheduler.update(plan, StepResult(plan.step, computed={2: 16}, tokens={2: 1}))
    assert scheduler.counters.prefill_tokens == 12 + 4  # request 1's prompt, then 2's 4
    assert kv.stats().matched_tokens == 12
    plan = scheduler.schedule()
    assert plan.decode == (2,) and table_of(plan, 2).cached is None
    conserved(kv, 2)


def test_a_prefix_hit_ending_inside_a_cached_block_copies_it_before_writing() -> None:
    prompt = ids(1, 12)
    scheduler, kv = cached(prompt, decoded=0)  # 12 written: 3 blocks cached

    # 10 tokens in common with 1's prompt: 2 whole blocks and 2 slots into its third block.
    scheduler.add(2, "a", [*prompt[:10], 55, 56])
    plan = scheduler.schedule()
    table = table_of(plan, 2)
    assert table.cached == table.num_tokens == 10
    assert plan.prefill == (PrefillWork(2, "a", 2),)
    (copy,) = table.copies
    assert copy.source in kv.tree.held_blocks() and copy.target == table.blocks[2]
    assert copy.target not in kv.tree.held_blocks()
    conserved(kv, 2)

    # The same prompt again: the hit is all of it but its last token (whose logits are needed).
    scheduler.add(3, "a", prompt)
    plan = scheduler.schedule()
    assert table_of(plan, 3).cached == 11 and len(table_of(plan, 3).copies) == 1
    assert PrefillWork(3, "a", 1) in plan.prefill
    conserved(kv, 2, 3)


def test_a_request_admitted_without_a_chunk_gets_its_copies_and_hit_in_its_first_plan() -> None:
    scheduler = make("a", max_step_tokens=4)
    prompt = ids(1, 12)
    scheduler.add(1, "a", prompt)
    kv = lease(scheduler, "a", num_blocks=40)
    for computed in (4, 8):
        step(scheduler, computed={1: computed})
    step(scheduler, computed={1: 12}, tokens={1: 1}, finish=[1])  # 3 blocks cached
    add(scheduler, 2, "a", 12)  # takes the whole budget
    scheduler.add(3, "a", [*prompt[:10], 55, 56])  # a partial hit: admitted beside 2, no chunk
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(2, "a", 4),) and kv.holds(3)  # 3 admitted, no budget for it
    for _ in range(5):  # 2's prefill, then its decode leaves 3 of the budget
        computed = all_written(plan)
        tokens = {r: 1 for r, n in computed.items() if r == 2 and n >= 12}
        scheduler.update(plan, StepResult(plan.step, computed=computed, tokens=tokens))
        plan = scheduler.schedule()
        if plan.prefill and plan.prefill[-1].request_id == 3:
            break
    table = table_of(plan, 3)  # its first plan
    assert table.cached == table.num_tokens == 10
    assert [c.target for c in table.copies] == [table.blocks[2]]


# ---------------------------------------------------------------------- preemption


def two_decoding(num_blocks: int) -> tuple[Scheduler, KVManager]:
    """Requests 1 and 2 (4-token prompts) of model "a", both past their prefill."""
    scheduler = make("a", max_running=2)
    add(scheduler, 1, "a", 4)
    add(scheduler, 2, "a", 4)
    kv = lease(scheduler, "a", num_blocks=num_blocks)
    to_decode(scheduler, 1, 2, prompt=4)
    return scheduler, kv


def test_a_decode_that_cannot_fit_preempts_the_newest_request_which_recomputes_from_its_cache() -> None:
    scheduler, kv = two_decoding(num_blocks=4)  # 1 block each, 2 free
    for _ in range(4):  # tokens 4..7: each opens its second block at token 4
        plan = step(scheduler, tokens={1: 3, 2: 3})
        assert plan.decode == (1, 2) and plan.preempted == ()
    assert kv.pool.num_free == 0 and kv.num_tokens(2) == 8
    # Token 8 needs a third block each; the pool holds none: the newest request goes.
    plan = step(scheduler, tokens={1: 3})
    assert plan.preempted == (2,) and plan.decode == (1,)
    assert {t.request_id for t in plan.tables} == {1}
    assert scheduler.request_state(2) == "waiting" and not kv.holds(2)
    assert scheduler.counters.preemptions == 1
    # Its 8 written tokens entered the cache (2 blocks); 1's third block evicted the tail one.
    assert kv.tree.num_cached_blocks == 1 and len(kv.table(1)) == 3
    conserved(kv, 1)
    for _ in range(2):
        assert step(scheduler, tokens={1: 3}).decode == (1,)  # no room to come back yet
    step(scheduler, tokens={1: 3}, finish=[1])

    # Back, in order: its prompt and the 5 tokens it generated, 9 in all, 4 of them cached.
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(2, "a", 5),) and table_of(plan, 2).cached == 4
    scheduler.update(plan, StepResult(plan.step, computed={2: 9}, tokens={2: 3}))
    assert scheduler.request_state(2) == "decode"
    plan = step(scheduler, tokens={2: 3}, finish=[2])
    assert plan.decode == (2,) and table_of(plan, 2).num_tokens == 9
    assert scheduler.num_unfinished() == 0 and scheduler.counters.preemptions == 1
    conserved(kv)


def test_a_preempted_request_keeps_its_place_by_arrival() -> None:
    scheduler, _ = two_decoding(num_blocks=4)
    for _ in range(4):
        step(scheduler, tokens={1: 3, 2: 3})
    add(scheduler, 3, "a", 1)  # arrives while 1 and 2 run: waits (max_running)
    assert step(scheduler, tokens={1: 3}).preempted == (2,)
    step(scheduler, tokens={1: 3}, finish=[1])
    plan = scheduler.schedule()
    assert [w.request_id for w in plan.prefill][:1] == [2]  # first in, first again
    assert scheduler.request_state(2) == "prefill"


def test_preemption_takes_a_prefilling_request_when_it_is_the_newest() -> None:
    scheduler = make("a", max_step_tokens=2)
    add(scheduler, 1, "a", 4)
    kv = lease(scheduler, "a", num_blocks=9)
    step(scheduler, computed={1: 2})
    step(scheduler, computed={1: 4}, tokens={1: 3})
    add(scheduler, 2, "a", 20)  # 5 blocks, +2 of headroom: 2 free after it
    preempted = ()
    for _ in range(20):  # 1 decodes a token a step, 2 prefills one beside it
        plan = scheduler.schedule()
        preempted = plan.preempted
        computed = all_written(plan)
        scheduler.update(plan, StepResult(plan.step, computed=computed, tokens={1: 3}))
        if preempted:
            break
    assert preempted == (2,) and plan.decode == (1,) and plan.prefill == ()
    assert kv.num_tokens(1) == 17 and scheduler.request_state(2) == "waiting"
    assert kv.tree.num_cached_blocks == 3  # the 12 prompt tokens it had written
    conserved(kv, 1)
    step(scheduler, tokens={1: 3}, finish=[1])
    plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(2, "a", 2),) and table_of(plan, 2).cached == 12


# ---------------------------------------------------------------------- lookahead


def test_lookahead_reserves_room_for_a_verify_pass_and_unused_blocks_go_back() -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 4)
    kv = lease(scheduler, "a", num_blocks=20, lookahead=6)
    to_decode(scheduler, 1, prompt=4)
    plan = scheduler.schedule()
    table = table_of(plan, 1)
    assert table.num_tokens == 4 and room(table) >= 1 + 6 and len(table.blocks) == 3
    assert kv.pool.num_free == 17
    # The verify pass accepted 2 drafts: the last token and those 2 are written (7); the bonus
    # token comes too. The third block held only rejected drafts: it goes back.
    scheduler.update(plan, StepResult(plan.step, computed={1: 7}, tokens={1: 10}, extra_tokens={1: (11, 12)}))
    assert kv.table(1) == table.blocks[:2] and kv.num_tokens(1) == 7 and kv.pool.num_free == 18
    plan = scheduler.schedule()
    assert table_of(plan, 1).num_tokens == 7 and room(table_of(plan, 1)) >= 7
    # Nothing accepted: one written, the rest rolled back again.
    scheduler.update(plan, StepResult(plan.step, computed={1: 8}, tokens={1: 13}))
    assert len(kv.table(1)) == 2 and kv.pool.num_free == 18
    scheduler.set_lookahead("a", 0)
    assert room(table_of(scheduler.schedule(), 1)) >= 1 and kv.pool.num_free == 17  # 8 + 1: a third block


def test_a_short_pool_drops_the_lookahead_before_preempting_anyone() -> None:
    scheduler, kv = two_decoding(num_blocks=5)  # 1 block each, 3 free
    scheduler.set_lookahead("a", 6)  # 7 slots from token 4: 2 more blocks each, 4 in all
    plan = scheduler.schedule()
    assert plan.preempted == () and plan.decode == (1, 2)
    assert all(room(table_of(plan, r)) >= 1 for r in plan.decode)
    assert min(room(table_of(plan, r)) for r in plan.decode) < 7
    conserved(kv, 1, 2)
    scheduler.update(plan, StepResult(plan.step, computed={1: 5, 2: 5}, tokens={1: 3, 2: 3}))
    assert scheduler.counters.preemptions == 0


# ---------------------------------------------------------------------- liveness


def test_a_request_whose_prompt_and_first_token_fit_the_pool_is_admitted() -> None:
    scheduler = make("a")
    add(scheduler, 1, "a", 15)
    lease(scheduler, "a", num_blocks=4)
    for _ in range(3):
        plan = scheduler.schedule()
    assert plan.prefill == (PrefillWork(1, "a", 15),)


# ---------------------------------------------------------------------- the lane, through the scheduler


def run_lanes(scheduler: Scheduler, steps: int) -> list[str | None]:
    """Every planned prefill completes and every decode gets a token (nothing ever finishes)."""
    owners = []
    for _ in range(steps):
        plan = scheduler.schedule()
        owners.append(plan.decode_model)
        computed = all_written(plan)
        scheduler.update(plan, StepResult(plan.step, computed=computed, tokens=dict.fromkeys(computed, 1)))
    return owners


def decoding(scheduler: Scheduler, models: list[str], priorities: dict[str, int] | None = None) -> None:
    """One decode-ready request per model, all in one step."""
    for request_id, model in enumerate(models, start=1):
        add(scheduler, request_id, model, 2, (priorities or {}).get(model, 0))
    step(scheduler)
    for model in models:
        scheduler.model_ready(model, KVManager(100, B))
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
    assert step(scheduler, tokens={1: 1}, finish=[1]).decode_model == "a"
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


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: the next token is a function of the sequence, so equal prompts continue
    alike (and their generated tokens hit the prefix cache too)."""
    return 1000 + (tokens[-1] * 7 + len(tokens)) % 11


@dataclass
class FakeRequest:
    id: int
    model: str
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int
    tokens: list[int] = field(default_factory=list)  # the prompt, then every token generated
    kv: int = 0  # tokens of KV written, as the plans' tables say
    placed: bool = False  # in a plan since it was last admitted
    ended: str | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class FakeEngine:
    """Plays the engine, its loader and its runner honestly around the scheduler under test.

    Loader: one load at a time, in order, each taking 0..`load_delay` steps, before or after the
    step's releases (as the real engine races them); a lease is refused for room when `lease_cap`
    models hold one, and fails outright with probability `fail_p`; a granted lease comes with a
    fresh `KVManager` of `pool_blocks` blocks and a lookahead of 0 or `lookahead` slots. Runner: a
    cache of token ids per leased model, one per slot of each block; it applies each table's copies,
    checks that every request of the plan reads back its own tokens from its table and that the
    table has room for its work, then writes a prefill chunk's tokens (sampling the first token at
    the prompt's end) or a decode's last token and drafts, accepting a random number of the
    drafts; with probability `request_fail_p` a request fails instead (garbage in its slots).
    Engine: after each update a request finishes (`Scheduler.finish`) with "length" at its
    max_tokens, or "stop" with probability `eos_p`. After every plan and every update the KV
    blocks of each leased model are conserved: each is free, or held once per table of a running
    request and once by the prefix tree, and every running request holds one prefix lock.
    """

    scheduler: Scheduler
    rng: random.Random
    pool_blocks: int
    block_size: int
    lease_cap: int
    load_delay: int = 0
    lookahead: int = 0
    eos_p: float = 0.0
    fail_p: float = 0.0
    request_fail_p: float = 0.0
    requests: dict[int, FakeRequest] = field(default_factory=dict)
    kvs: dict[str, KVManager] = field(default_factory=dict)  # leased models' blocks
    slots: dict[str, list[list[int | None]]] = field(default_factory=dict)  # their caches
    lookaheads: dict[str, int] = field(default_factory=dict)
    loads: list[str] = field(default_factory=list)
    load_wait: int = 0
    inbox: list[tuple[str, str]] = field(default_factory=list)
    monitor: LaneMonitor = field(default_factory=LaneMonitor)
    plans: list[StepPlan] = field(default_factory=list)
    failed_models: set[str] = field(default_factory=set)
    failed_requests: set[int] = field(default_factory=set)
    short_chunks: set[int] = field(default_factory=set)  # asked for less than was left, last step
    hit_tokens: int = 0
    copies: int = 0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def submit(
        self, request_id: int, model: str, prompt: Sequence[int], max_tokens: int, priority: int
    ) -> None:
        # The engine's check: the request alone fits the pool (its last token's KV is never written)
        assert self.blocks_for(len(prompt) + max_tokens - 1) <= self.pool_blocks
        self.requests[request_id] = FakeRequest(request_id, model, tuple(prompt), max_tokens, priority)
        self.scheduler.add(request_id, model, prompt, priority)

    def abort(self, request_id: int) -> None:
        if self.requests[request_id].ended is None:
            self.scheduler.abort(request_id)

    def step(self) -> tuple[StepPlan, StepResult]:
        for kind, name in self.inbox:  # the loop drains its inbox before each plan
            if kind == "ready":
                self.scheduler.model_ready(name, self.kvs[name], self.lookaheads[name])
            elif kind == "blocked":
                self.scheduler.model_blocked(name, "no room")
            else:
                self.scheduler.model_failed(name, "load failed")
        self.inbox = []
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        self.check_blocks()
        self.loads.extend(plan.acquire)
        race = self.rng.random() < 0.5
        if race:
            self._load()
        result = self._execute(plan)
        if not race:
            self._load()
        self.scheduler.update(plan, result)
        self._finish(result)
        self.check_blocks()
        return plan, result

    def check_blocks(self) -> None:
        for model, kv in self.kvs.items():
            mine = [r.id for r in self.requests.values() if r.model == model]
            holders = [r for r in mine if kv.holds(r)]
            assert holders == [r for r in mine if self.scheduler.request_state(r) in ("prefill", "decode")]
            conserved(kv, *holders)
            assert kv.tree.num_locks == len(holders)

    def _load(self) -> None:
        """Answer the queued acquires in order, until one takes a while (a load from disk)."""
        while self.loads:
            if self.load_wait < self.load_delay and self.rng.random() < 0.5:
                self.load_wait += 1
                return
            self.load_wait = 0
            name = self.loads.pop(0)
            assert name not in self.kvs, f"{name} acquired while it holds a lease"
            if self.rng.random() < self.fail_p:
                self.failed_models.add(name)
                self.inbox.append(("failed", name))
            elif len(self.kvs) >= self.lease_cap:
                self.inbox.append(("blocked", name))
            else:
                self.kvs[name] = KVManager(self.pool_blocks, self.block_size)
                self.slots[name] = [[None] * self.block_size for _ in range(self.pool_blocks)]
                self.lookaheads[name] = self.rng.choice([0, self.lookahead])
                self.inbox.append(("ready", name))

    def _end(self, request: FakeRequest, reason: str) -> None:
        assert request.ended is None, f"request {request.id} ended twice"
        request.ended = reason

    def _room(self, table: BlockTable) -> int:
        return len(table.blocks) * self.block_size - table.num_tokens

    def _write(self, request: FakeRequest, table: BlockTable, values: Sequence[int]) -> None:
        """Write `values` into the request's slots from its KV's end on."""
        assert request.kv + len(values) <= len(table.blocks) * self.block_size
        cache = self.slots[request.model]
        for position, value in enumerate(values, start=request.kv):
            cache[table.blocks[position // self.block_size]][position % self.block_size] = value

    def _read(self, request: FakeRequest, table: BlockTable) -> list[int | None]:
        cache = self.slots[request.model]
        size = self.block_size
        return [cache[table.blocks[i // size]][i % size] for i in range(table.num_tokens)]

    def _execute(self, plan: StepPlan) -> StepResult:
        result = StepResult(plan.step)
        for request_id, reason, _message in plan.close:
            request = self.requests[request_id]
            assert request.model not in self.kvs or not self.kvs[request.model].holds(request_id)
            self._end(request, reason)
        for request_id in plan.preempted:
            request = self.requests[request_id]
            assert request.ended is None
            request.kv, request.placed = 0, False
        for table in plan.tables:  # the copies first: a table may read a block another copies
            cache = self.slots[self.requests[table.request_id].model]
            for copy in table.copies:
                cache[copy.target] = list(cache[copy.source])
            self.copies += len(table.copies)
        for table in plan.tables:
            request = self.requests[table.request_id]
            kv = self.kvs[request.model]
            assert request.ended is None
            assert (table.blocks, table.num_tokens) == (kv.table(request.id), kv.num_tokens(request.id))
            if not request.placed:  # its first plan since it was admitted: it starts at its hit
                assert table.cached == table.num_tokens, table
                assert request.kv == 0 and table.num_tokens < len(request.tokens), (table, request)
                request.kv, request.placed = table.num_tokens, True
                self.hit_tokens += table.num_tokens
            else:
                assert table.cached is None, table
            assert table.num_tokens == request.kv, (table, request)
            assert self._read(request, table) == request.tokens[: request.kv], (table, request)
        self.short_chunks = set()
        for w in plan.prefill:
            request, table = self.requests[w.request_id], table_of(plan, w.request_id)
            assert w.model == request.model
            left = len(request.tokens) - request.kv
            assert 1 <= w.max_tokens <= left, (w, left)
            assert self._room(table) >= w.max_tokens, (w, table)
            if w.max_tokens < left:
                self.short_chunks.add(w.request_id)
        for request_id in plan.decode:
            request, table = self.requests[request_id], table_of(plan, request_id)
            assert request.model == plan.decode_model and request.generated >= 1
            assert request.kv == len(request.tokens) - 1  # prefilled
            assert self._room(table) >= 1, table
        if plan.decode_model is not None:
            self.monitor.enter(plan.decode_model)
        for w in plan.prefill:
            request, table = self.requests[w.request_id], table_of(plan, w.request_id)
            if not self._failed(request, table, result):
                self._write(request, table, request.tokens[request.kv : request.kv + w.max_tokens])
                request.kv += w.max_tokens
                result.computed[request.id] = request.kv
                if request.kv == len(request.tokens):  # the prompt's end: its first token
                    request.tokens.append(next_token(request.tokens))
                    result.tokens[request.id] = request.tokens[-1]
        for request_id in plan.decode:
            request, table = self.requests[request_id], table_of(plan, request_id)
            if not self._failed(request, table, result):
                self._decode(request, table, result)
        if plan.decode_model is not None:
            self.monitor.exit(plan.decode_model)
        for model in plan.release:
            kv = self.kvs.pop(model)
            assert not [r.id for r in self.requests.values() if r.model == model and kv.holds(r.id)]
            assert kv.pool.num_free + kv.tree.num_cached_blocks == self.pool_blocks
            assert kv.tree.num_locks == 0
            kv.tree.validate()
            del self.slots[model], self.lookaheads[model]
        return result

    def _failed(self, request: FakeRequest, table: BlockTable, result: StepResult) -> bool:
        if self.rng.random() >= self.request_fail_p:
            return False
        self._write(request, table, [-2] * self._room(table))  # half-written garbage
        result.failed[request.id] = "forward failed"
        self.failed_requests.add(request.id)
        self._end(request, "error")
        return True

    def _decode(self, request: FakeRequest, table: BlockTable, result: StepResult) -> None:
        """A plain decode, or a verify pass over as many drafts as the lookahead and the table allow:
        the last token and the drafts are written, `accepted` of them are right."""
        drafts = min(self.lookaheads[request.model], self._room(table) - 1)
        accepted = self.rng.randint(0, max(0, min(drafts, request.max_tokens - request.generated - 1)))
        new: list[int] = []
        for _ in range(1 + accepted):
            new.append(next_token(request.tokens + new))
        self._write(request, table, [request.tokens[-1], *new[:accepted]] + [-1] * (drafts - accepted))
        request.tokens += new
        request.kv += 1 + accepted
        result.computed[request.id] = request.kv
        result.tokens[request.id] = new[0]
        if accepted:
            result.extra_tokens[request.id] = tuple(new[1:])

    def _finish(self, result: StepResult) -> None:
        for request_id in result.tokens:
            request = self.requests[request_id]
            if request.generated >= request.max_tokens:
                reason = "length"
            elif self.rng.random() < self.eos_p:
                reason = "stop"
            else:
                continue
            self.scheduler.finish(request_id)
            self._end(request, reason)


def test_a_blocked_model_is_not_starved_by_a_stream_of_requests_for_the_holder() -> None:
    # Room for one lease. m0 is leased and gets a new request every step; m1's one request must
    # still be served once the m0 requests that came before it are done (the admission gate).
    scheduler = Scheduler(SchedulerConfig(lane_policy="throughput", max_step_tokens=64))
    for model in ("m0", "m1"):
        scheduler.register_model(model)
    engine = FakeEngine(scheduler, random.Random(1), pool_blocks=64, block_size=4, lease_cap=1)
    engine.submit(1, "m0", ids(1, 4), 6, 0)
    for _ in range(3):
        engine.step()
    engine.submit(2, "m0", ids(2, 4), 6, 0)
    engine.submit(3, "m1", ids(3, 4), 6, 0)
    for request_id in range(4, 60):
        engine.submit(request_id, "m0", ids(request_id, 4), 6, 0)
        engine.step()
        if engine.requests[3].ended:
            break
    assert engine.requests[3].ended == "length"
    assert engine.requests[1].ended == engine.requests[2].ended == "length"
    assert request_id < 30, request_id
    while scheduler.num_unfinished() or engine.kvs or engine.loads or engine.inbox:
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


SYSTEM_PROMPT = [500 + i for i in range(40)]  # the prefix prompts share


@st.composite
def workloads(draw: st.DrawFn, policy: str, partial_hits: bool = False) -> dict:
    """Random arrivals. A prompt is a whole-block prefix of SYSTEM_PROMPT and a tail of its own
    (prefix-cache hits of whole blocks), or with `partial_hits` any prefix of it and a tail from
    three token ids (equal prompts, hits ending inside a block: copy-on-write)."""
    num_models = draw(st.integers(3, 4))
    block_size = draw(st.sampled_from([2, 4]))
    requests = []
    for index in range(1, draw(st.integers(1, 24)) + 1):
        length = draw(st.integers(1, 40))
        if partial_hits:
            shared = draw(st.integers(0, length))
            tail = draw(st.lists(st.integers(0, 2), min_size=length - shared, max_size=length - shared))
        else:
            shared = draw(st.integers(0, (length - 1) // block_size)) * block_size
            tail = [100_000 * index + i for i in range(length - shared)]
        requests.append(
            (
                draw(st.integers(0, 40)),  # arrival step
                draw(st.integers(0, num_models - 1)),
                SYSTEM_PROMPT[:shared] + tail,
                draw(st.integers(1, 24)),  # max tokens
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
        "pool_blocks": math.ceil(63 / block_size) + draw(st.sampled_from([0, 0, 0, 1, 2, 4, 8, 12])),
        "lease_cap": draw(st.integers(1, 3)),
        "load_delay": draw(st.integers(0, 3)),
        "lookahead": draw(st.sampled_from([0, 3])),
        "eos_p": draw(st.sampled_from([0.0, 0.1])),
        "fail_p": draw(st.sampled_from([0.0, 0.0, 0.15])),
        "request_fail_p": draw(st.sampled_from([0.0, 0.0, 0.02])),
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
        w["lookahead"],
        w["eos_p"],
        w["fail_p"],
        w["request_fail_p"],
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
        engine.check_blocks()  # an abort lets its blocks go at once
        settled = not (engine.kvs or engine.loads or engine.inbox or scheduler.has_pending_events())
        if not arrivals and not aborts and scheduler.num_unfinished() == 0 and settled:
            break
        ready = {r for r in engine.requests if scheduler.request_state(r) == "decode"}
        plan, _ = engine.step()

        # The lane: one model decodes, every one of its decode-ready requests with it but those
        # preempted for its blocks (all of that model: the lane's).
        decode_models = {engine.requests[r].model for r in plan.decode}
        assert decode_models <= {plan.decode_model}, plan
        preempted_models = {engine.requests[r].model for r in plan.preempted}
        assert len(preempted_models) <= 1 and (not plan.decode or preempted_models <= decode_models), plan
        if plan.decode_model is not None:
            mine = {r for r in ready if engine.requests[r].model == plan.decode_model}
            assert mine - set(plan.preempted) == set(plan.decode), (plan, mine)
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
        # No starvation: a decode-ready request decodes within the policy's bound (or is preempted).
        sat_out = {
            r: sat_out.get(r, 0) + 1 for r in ready if r not in plan.decode and r not in plan.preempted
        }
        worst = max(worst, *sat_out.values(), 0)
        assert worst <= bound, (config.lane_policy, worst, bound, sat_out)
    else:
        pytest.fail(f"not done after 3000 steps: {scheduler.num_unfinished()} unfinished")

    # Nothing lost: every request ended once, through close, finish or failure, for a fitting reason.
    for request in engine.requests.values():
        assert request.ended is not None, request
        if request.ended == "error":
            assert request.model in engine.failed_models or request.id in engine.failed_requests, request
        elif request.ended == "length":
            assert request.generated == request.max_tokens, request
        else:
            assert request.ended in ("stop", "abort"), request
    assert engine.monitor.max_concurrent == (1 if any(p.decode for p in engine.plans) else 0)
    assert scheduler.counters.decode_steps == sum(1 for p in engine.plans if p.decode)
    assert scheduler.counters.preemptions == sum(len(p.preempted) for p in engine.plans)
    assert all(scheduler.model_state(m) == "idle" for m in w["models"])
    return worst, bound


@pytest.mark.parametrize("policy", LANE_POLICIES)
def test_random_workloads_lose_nothing_starve_nobody_and_conserve_blocks(policy: str) -> None:
    @settings(max_examples=120, deadline=None)
    @given(workloads(policy))
    def check(w: dict) -> None:
        run_workload(w)

    check()


def test_random_workloads_with_hits_ending_inside_blocks_read_back_their_own_tokens() -> None:
    @settings(max_examples=120, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
    @given(workloads("throughput", partial_hits=True))
    def check(w: dict) -> None:
        run_workload(w)

    check()
