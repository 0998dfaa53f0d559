"""The thread policy: every CPU while the machine is idle, one fewer per core other processes keep
busy (at least one), down at once and up only after a steady quiet; a fixed count never moves."""

from __future__ import annotations

import pytest

from polylane.policy.scheduling.threads import CpuSample, ThreadPolicy


def _feed(policy: ThreadPolicy, loads: list[tuple[float, float]], interval: float = 0.5) -> list[int]:
    """Samples `interval` apart where others keep `other` cores busy and we use `own` cores;
    the count after each."""
    wall = busy = own = 0.0
    counts = [policy.observe(CpuSample(wall, busy, own))]
    for other, ours in loads:
        wall += interval
        busy += (other + ours) * interval
        own += ours * interval
        counts.append(policy.observe(CpuSample(wall, busy, own)))
    return counts


def test_an_idle_machine_keeps_every_cpu() -> None:
    policy = ThreadPolicy(cpus=2)
    assert _feed(policy, [(0.0, 2.0)] * 4) == [2] * 5
    assert policy.other_load == 0.0


def test_one_busy_core_of_two_drops_to_one_thread_at_once() -> None:
    policy = ThreadPolicy(cpus=2)
    counts = _feed(policy, [(0.0, 2.0), (1.0, 1.0), (1.0, 1.0)])
    assert counts == [2, 2, 1, 1]
    assert policy.other_load == pytest.approx(1.0)


def test_threads_rise_only_after_the_neighbour_stays_quiet() -> None:
    policy = ThreadPolicy(cpus=2, rise_after=2)
    counts = _feed(policy, [(1.0, 1.0), (0.0, 1.0), (1.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 2.0)])
    # a single quiet sample between busy ones does not flap; two in a row restore both threads
    assert counts == [2, 1, 1, 1, 1, 2, 2]


def test_a_little_other_load_is_ignored() -> None:
    policy = ThreadPolicy(cpus=2, busy_margin=0.3)
    assert _feed(policy, [(0.25, 2.0), (0.25, 2.0)]) == [2, 2, 2]
    assert policy.wanted(0.31) == 1 and policy.wanted(0.29) == 2


def test_many_cores_give_up_one_thread_per_busy_core_and_never_go_below_one() -> None:
    policy = ThreadPolicy(cpus=16)
    assert policy.wanted(0.0) == 16
    assert policy.wanted(1.0) == 15
    assert policy.wanted(3.2) == 13
    assert policy.wanted(40.0) == 1


def test_a_ceiling_below_the_cpus_is_kept() -> None:
    policy = ThreadPolicy(cpus=8, max_threads=4)
    assert policy.threads == 4 and policy.wanted(0.0) == 4 and policy.wanted(5.0) == 3


def test_a_fixed_count_never_changes() -> None:
    policy = ThreadPolicy(cpus=2, fixed=2)
    assert not policy.adaptive and not policy.due(10.0)
    assert _feed(policy, [(1.0, 1.0)] * 3) == [2] * 4


def test_a_sample_is_due_once_an_interval_has_passed() -> None:
    policy = ThreadPolicy(cpus=2, interval_s=0.25)
    assert policy.due(0.0)
    policy.observe(CpuSample(0.0, 0.0, 0.0))
    assert not policy.due(0.2) and policy.due(0.25)


@pytest.mark.parametrize(("cpus", "fixed"), [(0, None), (2, 0)])
def test_nonsense_counts_are_refused(cpus: int, fixed: int | None) -> None:
    with pytest.raises(ValueError):
        ThreadPolicy(cpus=cpus, fixed=fixed)
