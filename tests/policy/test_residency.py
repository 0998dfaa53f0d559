"""ResidencyPool: hand cases for every rule, and a stateful property test against a reference model
(plain dicts and an LRU list) that checks the budget, pins, in-flight models, refused operations
and the order of evictions after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from polylane.policy.residency import (
    COLD,
    LOADING,
    RESIDENT,
    ModelBusyError,
    NoRoomError,
    PinnedError,
    ResidencyError,
    ResidencyPool,
    UnknownModelError,
)


def pool_with(budget: int, **sizes: int) -> ResidencyPool:
    pool = ResidencyPool(budget)
    for name, size in sizes.items():
        pool.register(name, size)
    return pool


def load(pool: ResidencyPool, name: str, actual: int | None = None) -> list[str]:
    evicted = [e.name for e in pool.begin_load(name)]
    if pool.state(name).state == LOADING:
        size = pool.state(name).bytes if actual is None else actual
        evicted += [e.name for e in pool.finish_load(name, size, handle=f"handle-{name}")]
    return evicted


def states(pool: ResidencyPool) -> dict[str, str]:
    return {s.name: s.state for s in pool.snapshot()}


def test_lru_victim_is_the_least_recently_used_idle_model() -> None:
    pool = pool_with(100, a=40, b=40, c=40)
    assert load(pool, "a") == [] and load(pool, "b") == []
    pool.acquire("a")
    pool.release("a")  # a is now more recent than b
    assert load(pool, "c") == ["b"]
    assert states(pool) == {"a": RESIDENT, "b": COLD, "c": RESIDENT}
    pool.validate()


def test_eviction_returns_the_handle_of_what_was_dropped() -> None:
    pool = pool_with(50, a=40, b=40)
    load(pool, "a")
    [eviction] = pool.begin_load("b")
    assert (eviction.name, eviction.bytes, eviction.cause, eviction.handle) == ("a", 40, "room", "handle-a")


def test_refused_admission_changes_nothing() -> None:
    pool = pool_with(100, a=40, b=40, big=90)
    load(pool, "a")
    load(pool, "b")
    pool.pin("a")
    before = (pool.snapshot(), pool.counters())
    with pytest.raises(NoRoomError, match="a \\(40 bytes, pinned\\)"):
        pool.begin_load("big")
    assert (pool.snapshot(), pool.counters()) == before


def test_in_flight_models_are_never_victims() -> None:
    pool = pool_with(100, a=60, b=60)
    load(pool, "a")
    pool.acquire("a")
    with pytest.raises(NoRoomError, match="in flight"):
        pool.begin_load("b")
    with pytest.raises(ModelBusyError):
        pool.evict("a")
    pool.release("a")
    assert load(pool, "b") == ["a"]


def test_readmitting_a_resident_model_only_refreshes_recency() -> None:
    pool = pool_with(100, a=40, b=40, c=40)
    load(pool, "a")
    load(pool, "b")
    assert pool.begin_load("a") == []  # a hit: no load, a becomes most recent
    counters = pool.counters()
    assert (counters.hits, counters.misses) == (1, 2)
    assert load(pool, "c") == ["b"]


def test_set_budget_shrinks_by_lru_grows_freely_and_refuses_below_pinned() -> None:
    pool = pool_with(200, a=50, b=50, c=50)
    for name in ("a", "b", "c"):
        load(pool, name)
    pool.pin("c")
    evicted = pool.set_budget(60)
    assert [(e.name, e.cause) for e in evicted] == [("a", "budget"), ("b", "budget")]
    before = (pool.snapshot(), pool.counters())
    with pytest.raises(NoRoomError, match="shrink"):
        pool.set_budget(40)  # c alone is pinned at 50
    assert (pool.snapshot(), pool.counters()) == before and pool.budget_bytes == 60
    assert pool.set_budget(1000) == []


def test_explicit_evict_of_pinned_needs_force() -> None:
    pool = pool_with(100, a=40)
    pool.pin("a")
    load(pool, "a")
    with pytest.raises(PinnedError):
        pool.evict("a")
    assert pool.evict("a", force=True).cause == "explicit"
    assert pool.state("a").state == COLD and pool.state("a").pinned


def test_measured_size_larger_than_reserved_evicts_more_or_reverts() -> None:
    pool = pool_with(100, a=30, b=30, c=30)
    load(pool, "a")
    load(pool, "b")
    pool.begin_load("c")
    evicted = pool.finish_load("c", 60, handle="c")
    assert [e.name for e in evicted] == ["a"] and pool.used_bytes == 90
    pool.pin("b")
    pool.register("d", 5)
    pool.begin_load("d")
    with pytest.raises(NoRoomError):
        pool.finish_load("d", 200, handle="d")
    assert pool.state("d").state == COLD and pool.used_bytes == 90
    pool.validate()


def test_failed_load_returns_its_reservation() -> None:
    pool = pool_with(100, a=40, b=70)
    load(pool, "a")
    evicted = pool.begin_load("b")
    assert [e.name for e in evicted] == ["a"]
    pool.abort_load("b")
    assert pool.used_bytes == 0 and states(pool) == {"a": COLD, "b": COLD}


def test_errors_name_the_problem() -> None:
    pool = pool_with(100, a=40)
    with pytest.raises(UnknownModelError, match="registered: a"):
        pool.begin_load("zzz")
    with pytest.raises(ResidencyError, match="already registered"):
        pool.register("a", 1)
    with pytest.raises(ResidencyError, match="load it before"):
        pool.acquire("a")
    with pytest.raises(ResidencyError, match="no request in flight"):
        pool.release("a")
    pool.begin_load("a")
    with pytest.raises(ModelBusyError, match="already loading"):
        pool.begin_load("a")
    with pytest.raises(ModelBusyError):
        pool.unregister("a")


NAMES = ["m0", "m1", "m2", "m3", "m4"]


class ResidencyMachine(RuleBasedStateMachine):
    """Random operations against a reference of dicts and an LRU list."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = ResidencyPool(100)
        self.budget = 100
        self.size: dict[str, int] = {}
        self.resident: set[str] = set()
        self.pinned: set[str] = set()
        self.flight: dict[str, int] = {}
        self.lru: list[str] = []  # least recent first

    def _victims(self, shortfall: int, exclude: str | None) -> list[str] | None:
        victims, freed = [], 0
        for name in self.lru:
            if freed >= shortfall:
                break
            idle = name in self.resident and not self.flight[name]
            if idle and name not in self.pinned and name != exclude:
                victims.append(name)
                freed += self.size[name]
        return victims if freed >= shortfall else None

    def _used(self) -> int:
        return sum(self.size[n] for n in self.resident)

    def _touch(self, name: str) -> None:
        if name in self.lru:
            self.lru.remove(name)
        self.lru.append(name)

    def _refused(self, call, *args) -> bool:
        before = (self.pool.snapshot(), self.pool.counters(), self.pool.budget_bytes)
        try:
            result = call(*args)
        except ResidencyError:
            assert (self.pool.snapshot(), self.pool.counters(), self.pool.budget_bytes) == before
            return True
        self.result = result
        return False

    @rule(name=st.sampled_from(NAMES), size=st.integers(0, 70), pinned=st.booleans())
    def register(self, name: str, size: int, pinned: bool) -> None:
        refused = self._refused(self.pool.register, name, size, pinned)
        assert refused == (name in self.size)
        if not refused:
            self.size[name] = size
            self.flight[name] = 0
            if pinned:
                self.pinned.add(name)

    @rule(name=st.sampled_from(NAMES), grow=st.integers(-10, 20))
    def load(self, name: str, grow: int) -> None:
        if name not in self.size:
            assert self._refused(self.pool.begin_load, name)
            return
        if name in self.resident:
            assert not self._refused(self.pool.begin_load, name) and self.result == []
            self._touch(name)
            return
        victims = self._victims(self._used() + self.size[name] - self.budget, name)
        refused = self._refused(self.pool.begin_load, name)
        assert refused == (victims is None), f"victims {victims}, refused {refused}"
        if refused:
            return
        assert [e.name for e in self.result] == victims
        self.resident.difference_update(victims)
        self.resident.add(name)
        self._touch(name)
        actual = max(0, self.size[name] + grow)
        more = self._victims(self._used() - self.size[name] + actual - self.budget, name)
        if more is None:
            with pytest.raises(NoRoomError):
                self.pool.finish_load(name, actual, handle=name)
            self.resident.discard(name)
            return
        evicted = self.pool.finish_load(name, actual, handle=name)
        assert [e.name for e in evicted] == more
        assert all(e.handle == e.name for e in evicted), "an eviction carried the wrong handle"
        self.resident.difference_update(more)
        self.size[name] = actual

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        refused = self._refused(self.pool.acquire, name)
        assert refused == (name not in self.resident)
        if not refused:
            self.flight[name] += 1
            self._touch(name)

    @rule(name=st.sampled_from(NAMES))
    def release(self, name: str) -> None:
        refused = self._refused(self.pool.release, name)
        assert refused == (not self.flight.get(name))
        if not refused:
            self.flight[name] -= 1

    @rule(name=st.sampled_from(NAMES), pin=st.booleans())
    def pin(self, name: str, pin: bool) -> None:
        if self._refused(self.pool.pin if pin else self.pool.unpin, name):
            assert name not in self.size
        elif pin:
            self.pinned.add(name)
        else:
            self.pinned.discard(name)

    @rule(name=st.sampled_from(NAMES), force=st.booleans())
    def evict(self, name: str, force: bool) -> None:
        allowed = name in self.resident and not self.flight[name] and (force or name not in self.pinned)
        assert self._refused(self.pool.evict, name, force) == (not allowed)
        if allowed:
            self.resident.discard(name)

    @rule(budget=st.integers(0, 200))
    def set_budget(self, budget: int) -> None:
        victims = self._victims(self._used() - budget, None)
        refused = self._refused(self.pool.set_budget, budget)
        assert refused == (victims is None)
        if not refused:
            assert [e.name for e in self.result] == victims
            self.resident.difference_update(victims)
            self.budget = budget

    @invariant()
    def matches_the_reference(self) -> None:
        self.pool.validate()
        assert self.pool.used_bytes <= self.pool.budget_bytes
        assert {s.name for s in self.pool.snapshot() if s.state == RESIDENT} == self.resident
        for name, count in self.flight.items():
            if count:
                assert name in self.resident, f"{name} has {count} in flight but was evicted"


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
