"""Lane policies called directly (fcfs, round-robin, priority with aging, throughput with a quantum)
and the LaneMonitor, the real counter of models inside a decode step at once.

The policies are also driven through the scheduler in tests/policy/test_scheduler.py.
"""

from __future__ import annotations

import itertools
import threading

import pytest

from polylane.policy.scheduling.lane import LaneCandidate, LaneMonitor, LaneOwner, LanePolicy

ORDER = {"a": 0, "b": 1, "c": 2, "d": 3}


def cand(model: str, oldest_ready_step: int, priority: int = 0) -> LaneCandidate:
    return LaneCandidate(model, ORDER[model], oldest_ready_step, priority)


def owner(model: str | None, held: int = 1) -> LaneOwner:
    return LaneOwner(model, ORDER.get(model, -1) if model else -1, held if model else 0)


def simulate(policy: LanePolicy, models: list[str], steps: int, priority: dict[str, int] | None = None):
    """Every model always has a request ready; the chosen one decodes (its token is new)."""
    priority = priority or {}
    ready = dict.fromkeys(models, 0)
    lane = LaneOwner()
    picks = []
    for step in range(1, steps + 1):
        chosen = policy.choose([cand(m, ready[m], priority.get(m, 0)) for m in models], lane, step)
        picks.append(chosen)
        ready[chosen] = step
        held = lane.held + 1 if lane.model == chosen else 1
        lane = LaneOwner(chosen, ORDER[chosen], held)
    return picks


# ---------------------------------------------------------------------- policies


def test_unknown_policy_and_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown lane policy"):
        LanePolicy("lottery")
    with pytest.raises(ValueError):
        LanePolicy("throughput", quantum=0)
    with pytest.raises(ValueError):
        LanePolicy("priority", aging_steps=0)
    with pytest.raises(ValueError):
        LanePolicy("fcfs").choose([], LaneOwner(), 1)


def test_fcfs_picks_the_oldest_waiting_token_ties_by_registration() -> None:
    fcfs = LanePolicy("fcfs")
    assert fcfs.choose([cand("a", 5), cand("b", 3), cand("c", 7)], owner("b"), 9) == "b"
    assert fcfs.choose([cand("c", 3), cand("b", 3), cand("a", 4)], owner(None), 9) == "b"
    # The owner gets no favour: it just decoded, so its tokens are the newest.
    assert fcfs.choose([cand("a", 8), cand("b", 2)], owner("a", held=1), 9) == "b"


def test_fcfs_alternates_step_by_step() -> None:
    assert simulate(LanePolicy("fcfs"), ["a", "b", "c"], 7) == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_cycles_in_registration_order() -> None:
    rr = LanePolicy("round-robin")
    assert rr.choose([cand("a", 1), cand("b", 1), cand("c", 1)], owner("a"), 5) == "b"
    assert rr.choose([cand("a", 1), cand("b", 1), cand("c", 1)], owner("c"), 5) == "a"  # wraps
    assert rr.choose([cand("a", 1), cand("c", 1)], owner("a"), 5) == "c"  # b has nothing ready
    assert rr.choose([cand("a", 1)], owner("a"), 5) == "a"  # alone: keeps the lane
    assert rr.choose([cand("c", 4), cand("b", 6)], owner(None), 7) == "c"  # no owner: oldest
    # Cycles by registration, not by age: c is the oldest but b comes after a.
    assert rr.choose([cand("b", 6), cand("c", 1)], owner("a"), 7) == "b"
    assert simulate(rr, ["a", "b", "c", "d"], 8) == ["a", "b", "c", "d"] * 2


def test_priority_picks_the_highest_priority() -> None:
    prio = LanePolicy("priority", aging_steps=8)
    assert prio.choose([cand("a", 9, 0), cand("b", 9, 2), cand("c", 9, 1)], owner(None), 10) == "b"
    # Equal effective priority: the oldest token, then registration order.
    assert prio.choose([cand("a", 9, 1), cand("b", 8, 1)], owner(None), 10) == "b"
    assert prio.choose([cand("b", 9, 1), cand("a", 9, 1)], owner(None), 10) == "a"


@pytest.mark.parametrize("aging_steps", [1, 3, 8])
@pytest.mark.parametrize("gap", [1, 2, 4])
def test_priority_ages_a_waiting_model_so_it_wins_within_the_bound(aging_steps: int, gap: int) -> None:
    prio = LanePolicy("priority", aging_steps=aging_steps)
    # "hi" decodes every step while "lo" has waited since step 0.
    waited = None
    for step in range(1, 10 * (gap + 1) * aging_steps):
        chosen = prio.choose([cand("a", step - 1, gap), cand("b", 0, 0)], owner("a", step), step)
        if chosen == "b":
            waited = step
            break
    assert waited is not None
    assert waited <= (gap + 1) * aging_steps  # the docstring's bound
    assert waited >= gap * aging_steps  # and aging is no faster than one level per aging_steps
    # Without the gap nobody waits: the lower priority still wins on age.
    assert prio.choose([cand("a", 4, 0), cand("b", 0, 0)], owner("a"), 5) == "b"


@pytest.mark.parametrize("models", [3, 4])
@pytest.mark.parametrize("aging_steps", [1, 2, 3])
def test_priority_bound_with_more_models(models: int, aging_steps: int) -> None:
    """(gap + 1) × aging_steps + models − 2 holds for every priority assignment; with quick aging
    the two-model bound alone would not (equal models take turns ahead of the waiting one)."""
    names = list("abcd"[:models])
    policy = LanePolicy("priority", aging_steps=aging_steps)
    over_two_model_bound = False
    for priorities in itertools.product(range(3), repeat=models):
        gap = max(priorities) - min(priorities)
        picks = simulate(policy, names, 80, dict(zip(names, priorities, strict=True)))
        for name in names:
            turns = [i for i, p in enumerate(picks) if p == name]
            assert turns, (name, priorities)
            wait = max(b - a - 1 for a, b in zip([-1, *turns], turns, strict=False))
            assert wait <= (gap + 1) * aging_steps + models - 2, (name, priorities, picks)
            over_two_model_bound |= wait > (gap + 1) * aging_steps
    if aging_steps == 1:
        assert over_two_model_bound


def test_priority_shares_the_lane_by_priority_over_time() -> None:
    picks = simulate(LanePolicy("priority", aging_steps=2), ["a", "b"], 60, priority={"a": 2, "b": 0})
    assert 0 < picks.count("b") < picks.count("a")  # b is served, a more often
    longest_b_wait = max(len(run) for run in "".join(picks).split("b"))
    assert longest_b_wait <= (2 + 1) * 2


def test_throughput_keeps_the_owner_for_a_quantum_then_switches() -> None:
    tp = LanePolicy("throughput", quantum=3)
    both = [cand("a", 10), cand("b", 1)]
    assert tp.choose(both, owner("a", held=1), 11) == "a"
    assert tp.choose(both, owner("a", held=2), 11) == "a"
    assert tp.choose(both, owner("a", held=3), 11) == "b"  # quantum spent
    assert tp.choose([cand("a", 10)], owner("a", held=9), 11) == "a"  # nobody else: keep it
    assert tp.choose([cand("b", 10)], owner("a", held=1), 11) == "b"  # owner has no work
    # After the quantum: the fcfs choice among the others.
    assert tp.choose([cand("a", 10), cand("b", 5), cand("c", 2)], owner("a", held=3), 11) == "c"
    assert tp.choose([cand("b", 5), cand("c", 5)], owner(None), 11) == "b"
    assert simulate(tp, ["a", "b", "c"], 12) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["a"] * 3


@pytest.mark.parametrize("policy", ["fcfs", "round-robin", "throughput"])
def test_no_model_waits_longer_than_the_policy_bound(policy: str) -> None:
    quantum, models = 3, ["a", "b", "c", "d"]
    picks = simulate(LanePolicy(policy, quantum=quantum), models, 100)
    bound = quantum * (len(models) - 1) if policy == "throughput" else len(models) - 1
    for model in models:
        steps = [i for i, p in enumerate(picks) if p == model]
        gaps = [b - a - 1 for a, b in zip([-1, *steps], steps, strict=False)]
        assert max(gaps) <= bound, (model, picks)


# ---------------------------------------------------------------------- the monitor


def test_monitor_counts_enters_and_exits() -> None:
    monitor = LaneMonitor()
    for model in ["a", "b", "a"]:
        monitor.enter(model)
        assert monitor.current == 1
        monitor.exit(model)
        assert monitor.current == 0
    assert monitor.decode_steps == 3
    assert monitor.max_concurrent == 1  # one after the other: never two at once
    assert monitor.inside == {}


def test_monitor_sees_two_models_nested() -> None:
    monitor = LaneMonitor()
    monitor.enter("a")
    monitor.enter("b")
    assert monitor.current == 2
    monitor.exit("b")
    monitor.exit("a")
    assert monitor.max_concurrent == 2
    assert monitor.current == 0


def test_monitor_same_model_twice_is_one_model() -> None:
    monitor = LaneMonitor()
    monitor.enter("a")
    monitor.enter("a")
    assert monitor.current == 1
    monitor.exit("a")
    assert monitor.current == 1  # still inside once
    monitor.exit("a")
    assert (monitor.max_concurrent, monitor.current, monitor.decode_steps) == (1, 0, 2)


def test_monitor_sees_two_models_from_two_threads() -> None:
    monitor = LaneMonitor()
    both_inside = threading.Barrier(2, timeout=10)

    def decode(model: str) -> None:
        monitor.enter(model)
        both_inside.wait()  # neither leaves before the other is in
        monitor.exit(model)

    threads = [threading.Thread(target=decode, args=(m,)) for m in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert monitor.max_concurrent == 2
    assert monitor.current == 0 and monitor.decode_steps == 2


def test_monitor_counts_drafters_inside_their_target_separately() -> None:
    monitor = LaneMonitor()
    monitor.enter("big")
    monitor.enter("small@big")  # the drafter runs in its target's slot
    assert monitor.current == 1
    monitor.exit("small@big")
    monitor.exit("big")
    assert (monitor.max_concurrent, monitor.max_concurrent_drafters) == (1, 1)
    assert monitor.decode_steps == 1  # drafter steps are not decode steps of their own

    monitor.enter("big")
    monitor.enter("small@other")  # a drafter for another target: a second model in the lane
    assert monitor.current == 2
    monitor.enter("tiny@big")
    assert monitor.max_concurrent_drafters == 2
    for model in ("tiny@big", "small@other", "big"):
        monitor.exit(model)
    assert monitor.max_concurrent == 2


def test_monitor_exit_without_enter_raises() -> None:
    monitor = LaneMonitor()
    with pytest.raises(RuntimeError, match="never entered"):
        monitor.exit("a")
    monitor.enter("a")
    monitor.exit("a")
    with pytest.raises(RuntimeError):
        monitor.exit("a")  # once more than it entered
    monitor.enter("a")
    with pytest.raises(RuntimeError):
        monitor.exit("b")
