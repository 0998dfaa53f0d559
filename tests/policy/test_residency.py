"""ResidencyPool: hand cases for every rule, and a stateful property test against a reference model
(plain dicts and an LRU list) that checks, after every step, the budget, pins, in-flight models,
refused operations (the pool unchanged), the victims and their order, and the counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from polylane.policy.residency import (
    COLD,
    LOADING,
    RESIDENT,
    Eviction,
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
    """Admit `name` (and finish its load if it was cold); the names evicted, in order."""
    evicted = [e.name for e in pool.begin_load(name)]
    if pool.state(name).state == LOADING:
        size = pool.state(name).bytes if actual is None else actual
        evicted += [e.name for e in pool.finish_load(name, size, handle=f"handle-{name}")]
    return evicted


def states(pool: ResidencyPool) -> dict[str, str]:
    return {s.name: s.state for s in pool.snapshot()}


def frozen(pool: ResidencyPool) -> tuple[object, ...]:
    """Everything observable about the pool, for before/after comparisons."""
    return (pool.snapshot(), pool.counters(), pool.budget_bytes, pool.used_bytes, pool.clock)


# ---------------------------------------------------------------------- LRU


def test_lru_victim_is_the_least_recently_used_idle_model() -> None:
    pool = pool_with(100, a=40, b=40, c=40)
    assert load(pool, "a") == [] and load(pool, "b") == []
    pool.acquire("a")
    pool.release("a")  # a is now more recent than b
    assert load(pool, "c") == ["b"]
    assert states(pool) == {"a": RESIDENT, "b": COLD, "c": RESIDENT}
    pool.validate()


def test_victims_are_taken_oldest_first_until_enough_is_free() -> None:
    pool = pool_with(100, a=30, b=30, c=30, d=50)
    for name in ("a", "b", "c"):
        load(pool, name)
    pool.acquire("b")
    pool.release("b")  # recency now: a < c < b
    assert pool.plan_admit("d") == ["a", "c"]
    assert [(e.name, e.cause) for e in pool.begin_load("d")] == [("a", "room"), ("c", "room")]
    pool.validate()


def test_an_older_victim_is_never_skipped_to_spare_a_bigger_one() -> None:
    pool = pool_with(100, small=10, big=50, new=60)
    load(pool, "small")
    load(pool, "big")
    # 20 bytes short: evicting `big` alone would do, but `small` is older and goes first.
    assert pool.plan_admit("new") == ["small", "big"]


def test_every_touch_gets_its_own_stamp_and_ties_break_by_registration_order() -> None:
    pool = pool_with(100, a=10, b=10, c=10, d=95)
    for name in ("c", "a", "b"):
        load(pool, name)
    pool.acquire("c")
    stamps = {s.name: s.last_used for s in pool.snapshot()}
    assert stamps == {"a": 2, "b": 3, "c": 4, "d": 0} and pool.clock == 4
    # A tie cannot be reached through the API (each tick stamps one model); the tie-break is a
    # guard that keeps the order total. Force one to see it: a and b share a stamp, a was
    # registered first, so a goes first.
    pool.release("c")
    pool._models["b"].last_used = pool._models["a"].last_used
    assert pool.plan_admit("d") == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match="share LRU stamps"):
        pool.validate()


def test_readmitting_a_resident_model_only_refreshes_recency() -> None:
    pool = pool_with(100, a=40, b=40, c=40)
    load(pool, "a")
    load(pool, "b")
    before = {s.name: s for s in pool.snapshot()}
    assert pool.plan_admit("a") == []
    assert pool.begin_load("a", size_bytes=99) == []  # a hit: no load, the measured size stands
    after = {s.name: s for s in pool.snapshot()}
    assert after["b"] == before["b"] and after["a"].last_used > after["b"].last_used
    assert (after["a"].state, after["a"].bytes, after["a"].loads) == (RESIDENT, 40, 1)
    counters = pool.counters()
    assert (counters.hits, counters.misses, counters.num_evictions) == (1, 2, 0)
    assert load(pool, "c") == ["b"]


# ---------------------------------------------------------------------- all or nothing


def test_eviction_returns_the_handle_of_what_was_dropped() -> None:
    pool = pool_with(50, a=40, b=40)
    load(pool, "a")
    [eviction] = pool.begin_load("b")
    assert eviction == Eviction("a", 40, "room", "handle-a")
    assert pool.handle("a") is None


def test_refused_admission_changes_nothing() -> None:
    pool = pool_with(100, a=40, b=40, big=90)
    load(pool, "a")
    load(pool, "b")
    pool.pin("a")
    before = frozen(pool)
    with pytest.raises(NoRoomError, match=r"'big' \(90 bytes\).*held: a \(40 bytes, pinned\)"):
        pool.plan_admit("big")
    with pytest.raises(NoRoomError, match=r"a \(40 bytes, pinned\)"):
        pool.begin_load("big")
    with pytest.raises(NoRoomError, match="larger than the whole budget"):
        pool.begin_load("big", size_bytes=101)
    assert frozen(pool) == before
    pool.validate()


def test_plan_admit_is_read_only_and_predicts_begin_load() -> None:
    pool = pool_with(100, a=30, b=30, c=30, d=10)
    for name in ("a", "b", "c"):
        load(pool, name)
    before = frozen(pool)
    assert pool.plan_admit("d") == []
    assert pool.plan_admit("d", size_bytes=45) == ["a", "b"]  # a measured size may differ
    assert frozen(pool) == before
    assert [e.name for e in pool.begin_load("d", size_bytes=45)] == ["a", "b"]
    assert pool.state("d").bytes == 45 and pool.used_bytes == 75
    with pytest.raises(ModelBusyError, match="already loading"):
        pool.plan_admit("d")


# ---------------------------------------------------------------------- what is never a victim


def test_in_flight_models_are_never_victims() -> None:
    pool = pool_with(100, a=60, b=60)
    load(pool, "a")
    assert pool.acquire("a") == "handle-a"
    before = frozen(pool)
    with pytest.raises(NoRoomError, match=r"a \(60 bytes, 1 in flight\)"):
        pool.begin_load("b")
    with pytest.raises(NoRoomError, match="in flight"):
        pool.set_budget(50)
    with pytest.raises(ModelBusyError, match="1 requests in flight"):
        pool.evict("a", force=True)
    assert frozen(pool) == before
    pool.release("a")
    assert load(pool, "b") == ["a"]


def test_loading_models_are_never_victims() -> None:
    pool = pool_with(100, a=60, b=50)
    assert pool.begin_load("a") == []
    before = frozen(pool)
    with pytest.raises(NoRoomError, match=r"a \(60 bytes, loading\)"):
        pool.begin_load("b")
    with pytest.raises(NoRoomError, match="loading"):
        pool.set_budget(50)
    with pytest.raises(ModelBusyError, match="is loading"):
        pool.evict("a")
    with pytest.raises(ResidencyError, match="still loading"):
        pool.acquire("a")
    with pytest.raises(ModelBusyError, match="already loading"):
        pool.begin_load("a")
    assert frozen(pool) == before


def test_pinned_models_survive_room_and_budget_evictions() -> None:
    pool = pool_with(100, a=50, b=30, c=40)
    pool.pin("a")  # pinned while cold: pinned once loaded
    load(pool, "a")
    load(pool, "b")
    assert pool.state("a").pinned and pool.pinned_bytes == 50
    assert load(pool, "c") == ["b"]  # a is older, but pinned
    before = frozen(pool)
    with pytest.raises(NoRoomError, match=r"a \(50 bytes, pinned\)"):
        pool.set_budget(40)
    with pytest.raises(NoRoomError, match="pinned"):
        pool.begin_load("b", size_bytes=55)  # evicting c frees 40 of the 45 short
    assert frozen(pool) == before
    pool.unpin("a")  # an unpinned model is a victim again, and the oldest
    assert [e.name for e in pool.begin_load("b", size_bytes=55)] == ["a"]


def test_pinned_model_that_fits_only_by_dropping_another_pinned_one_is_refused() -> None:
    pool = pool_with(100, a=60, b=60)
    pool.pin("a")
    pool.pin("b")
    load(pool, "a")
    with pytest.raises(NoRoomError, match=r"cannot load model 'b' \(60 bytes\).*a \(60 bytes, pinned\)"):
        pool.begin_load("b")


# ---------------------------------------------------------------------- budget


def test_set_budget_shrinks_by_lru_grows_freely_and_refuses_below_pinned() -> None:
    pool = pool_with(200, a=50, b=50, c=50)
    for name in ("a", "b", "c"):
        load(pool, name)
    pool.pin("c")
    evicted = pool.set_budget(60)
    assert [(e.name, e.cause) for e in evicted] == [("a", "budget"), ("b", "budget")]
    assert pool.budget_bytes == 60 and pool.used_bytes == 50
    before = frozen(pool)
    with pytest.raises(NoRoomError, match="cannot shrink the budget from 60 to 40 bytes"):
        pool.set_budget(40)  # c alone is pinned at 50
    assert frozen(pool) == before and pool.budget_bytes == 60
    assert pool.set_budget(1000) == []
    assert pool.counters().evictions_by_cause == {"room": 0, "budget": 2, "explicit": 0}


def test_set_budget_to_exactly_the_used_bytes_evicts_nothing() -> None:
    pool = pool_with(100, a=30, b=30)
    load(pool, "a")
    load(pool, "b")
    assert pool.set_budget(60) == []
    assert [e.name for e in pool.set_budget(59)] == ["a"]


# ---------------------------------------------------------------------- explicit evict


def test_explicit_evict_of_pinned_needs_force() -> None:
    pool = pool_with(100, a=40)
    pool.pin("a")
    load(pool, "a")
    with pytest.raises(PinnedError, match="'a' is pinned"):
        pool.evict("a")
    assert pool.evict("a", force=True) == Eviction("a", 40, "explicit", "handle-a")
    assert pool.state("a").state == COLD and pool.state("a").pinned  # the pin outlives the eviction
    with pytest.raises(ResidencyError, match="is cold, not resident"):
        pool.evict("a", force=True)
    pool.validate()


# ---------------------------------------------------------------------- finish / abort


def test_measured_size_larger_than_reserved_evicts_more() -> None:
    pool = pool_with(100, a=30, b=30, c=30)
    load(pool, "a")
    load(pool, "b")
    pool.begin_load("c")
    evicted = pool.finish_load("c", 60, handle="c")
    assert evicted == [Eviction("a", 30, "room", "handle-a")] and pool.used_bytes == 90
    assert pool.state("c").bytes == 60 and pool.counters().bytes_loaded == 30 + 30 + 60
    pool.validate()


def test_measured_size_that_cannot_fit_reverts_to_cold() -> None:
    pool = pool_with(100, a=30, b=30, d=5)
    load(pool, "a")
    load(pool, "b")
    pool.pin("b")
    pool.begin_load("d")
    with pytest.raises(NoRoomError, match=r"'d' as measured \(200 bytes, 5 reserved\).*back to cold"):
        pool.finish_load("d", 200, handle="d")
    assert pool.state("d").state == COLD and pool.state("d").bytes == 200  # the measured size is kept
    assert states(pool) == {"a": RESIDENT, "b": RESIDENT, "d": COLD} and pool.used_bytes == 60
    assert pool.handle("d") is None and pool.counters().bytes_loaded == 60
    pool.validate()


def test_measured_size_smaller_than_reserved_returns_the_difference() -> None:
    pool = pool_with(100, a=80)
    pool.begin_load("a")
    assert pool.finish_load("a", 50, handle="a") == [] and pool.used_bytes == 50


def test_failed_load_returns_its_reservation() -> None:
    pool = pool_with(100, a=40, b=70)
    load(pool, "a")
    evicted = pool.begin_load("b")
    assert [e.name for e in evicted] == ["a"]
    pool.abort_load("b")
    assert pool.used_bytes == 0 and states(pool) == {"a": COLD, "b": COLD}
    assert pool.counters().misses == 2 and pool.state("b").loads == 0
    with pytest.raises(ResidencyError, match="is cold, not loading"):
        pool.abort_load("b")
    pool.validate()


# ---------------------------------------------------------------------- registry, counters, errors


def test_unregister_only_when_cold() -> None:
    pool = pool_with(100, a=40, b=40)
    load(pool, "a")
    with pytest.raises(ModelBusyError, match="is resident; evict it"):
        pool.unregister("a")
    pool.evict("a")
    pool.unregister("a")
    assert "a" not in pool and len(pool) == 1
    pool.register("a", 10)  # a new model: last in registration order
    assert [s.name for s in pool.snapshot()] == ["b", "a"]
    pool.validate()


def test_counters_count_hits_misses_evictions_and_loaded_bytes() -> None:
    pool = pool_with(100, a=40, b=40, c=40)
    load(pool, "a", actual=45)
    load(pool, "b")
    load(pool, "a")  # hit
    load(pool, "c")  # evicts b
    pool.evict("c")
    pool.set_budget(10)  # evicts a
    counters = pool.counters()
    assert (counters.hits, counters.misses, counters.bytes_loaded) == (1, 3, 45 + 40 + 40)
    assert counters.evictions_by_cause == {"room": 1, "budget": 1, "explicit": 1}
    assert counters.evictions == counters.evictions_by_cause and counters.num_evictions == 3
    assert counters.hit_rate == pytest.approx(0.25)
    assert (counters.used_bytes, counters.budget_bytes, counters.pinned_bytes) == (0, 10, 0)
    assert [s.loads for s in pool.snapshot()] == [1, 1, 1]


def test_errors_name_the_problem() -> None:
    pool = pool_with(100, a=40)
    with pytest.raises(UnknownModelError, match="unknown model 'zzz'; registered: 'a'"):
        pool.begin_load("zzz")
    with pytest.raises(ResidencyError, match="already registered"):
        pool.register("a", 1)
    with pytest.raises(ResidencyError, match="whole number of bytes"):
        pool.register("x", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ResidencyError, match=">= 0 bytes"):
        pool.register("x", -1)
    with pytest.raises(ResidencyError, match=">= 0 bytes"):
        ResidencyPool(-1)
    with pytest.raises(ResidencyError, match="admit it with begin_load first"):
        pool.acquire("a")
    with pytest.raises(ResidencyError, match="no request in flight"):
        pool.release("a")
    with pytest.raises(ResidencyError, match="not loading; call begin_load first"):
        pool.finish_load("a", 40, handle="a")
    pool.begin_load("a")
    with pytest.raises(ResidencyError, match="needs the loaded object as handle"):
        pool.finish_load("a", 40, handle=None)
    with pytest.raises(ResidencyError, match="measured size must be >= 0"):
        pool.finish_load("a", -5, handle="a")
    with pytest.raises(ModelBusyError, match="already loading"):
        pool.begin_load("a")
    with pytest.raises(ModelBusyError):
        pool.unregister("a")
    assert pool.state("a").state == LOADING  # every refusal above left it loading
    assert issubclass(NoRoomError, ValueError) and issubclass(UnknownModelError, ResidencyError)


def test_validate_names_the_broken_invariant() -> None:
    pool = pool_with(100, a=40)
    load(pool, "a")
    pool.validate()
    pool._used_bytes = 10
    with pytest.raises(RuntimeError, match="used-bytes counter says 10"):
        pool.validate()
    pool._used_bytes = 40
    pool._models["a"].state = COLD
    with pytest.raises(RuntimeError, match="used-bytes counter"):
        pool.validate()
    pool._used_bytes = 0
    with pytest.raises(RuntimeError, match="a is cold with handle 'handle-a'"):
        pool.validate()


# ---------------------------------------------------------------------- stateful property test

NAMES = ["m0", "m1", "m2", "m3", "m4"]


class Reference:
    """An obviously correct residency pool: dicts, a set of pins, and a list for LRU order."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size: dict[str, int] = {}  # registration order, like the pool's snapshot
        self.state: dict[str, str] = {}
        self.pinned: set[str] = set()
        self.flight: dict[str, int] = {}
        self.loads: dict[str, int] = {}
        self.handle: dict[str, object] = {}
        self.lru: list[str] = []  # every model ever touched, least recently used first
        self.hits = self.misses = self.bytes_loaded = 0
        self.evictions = {"room": 0, "budget": 0, "explicit": 0}

    def used(self) -> int:
        return sum(self.size[n] for n, s in self.state.items() if s != COLD)

    def touch(self, name: str) -> None:
        if name in self.lru:
            self.lru.remove(name)
        self.lru.append(name)

    def victims(self, needed: int, budget: int) -> list[str] | None:
        """Oldest idle unpinned resident models first, until `needed` more bytes fit."""
        shortfall = self.used() + needed - budget
        victims, freed = [], 0
        for name in self.lru:
            if freed >= shortfall:
                break
            if self.state[name] == RESIDENT and name not in self.pinned and not self.flight[name]:
                victims.append(name)
                freed += self.size[name]
        return victims if freed >= shortfall else None

    def drop(self, names: list[str], cause: str) -> list[Eviction]:
        evictions = []
        for name in names:
            evictions.append(Eviction(name, self.size[name], cause, self.handle.pop(name)))
            self.state[name] = COLD
            self.evictions[cause] += 1
        return evictions


class ResidencyMachine(RuleBasedStateMachine):
    """Random operations, each predicted by the reference first: its outcome (the exact error
    class, or the result) and the evictions, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = ResidencyPool(100)
        self.ref = Reference(100)
        self.loads_started = 0
        self.force_evicted: set[str] = set()  # this step
        self.pinned_resident: set[str] = set()  # at the end of the last step

    def call(self, expected_error: type[Exception] | None, method: Callable[..., Any], *args: Any) -> Any:
        """Call `method`; if the reference expects a refusal, check its exact class and that the
        pool is unchanged."""
        if expected_error is None:
            return method(*args)
        before = frozen(self.pool)
        with pytest.raises(ResidencyError) as refused:
            method(*args)
        assert refused.type is expected_error, f"{method.__name__}{args}: {refused.value!r}"
        assert frozen(self.pool) == before, f"refused {method.__name__}{args} changed the pool"
        return None

    def lookup_error(self, name: str) -> type[Exception] | None:
        return UnknownModelError if name not in self.ref.state else None

    @initialize(
        sizes=st.lists(st.integers(0, 50), min_size=len(NAMES), max_size=len(NAMES)),
        pins=st.lists(st.booleans(), min_size=len(NAMES), max_size=len(NAMES)),
    )
    def register_all(self, sizes: list[int], pins: list[bool]) -> None:
        for name, size, pinned in zip(NAMES, sizes, pins, strict=True):
            self.register(name, size, pinned)

    @rule(name=st.sampled_from(NAMES), size=st.integers(0, 50), pinned=st.booleans())
    def register(self, name: str, size: int, pinned: bool) -> None:
        expected = ResidencyError if name in self.ref.state else None
        self.call(expected, self.pool.register, name, size, pinned)
        if expected is None:
            self.ref.size[name], self.ref.state[name] = size, COLD
            self.ref.flight[name] = self.ref.loads[name] = 0
            if pinned:
                self.ref.pinned.add(name)

    @rule(name=st.sampled_from(NAMES))
    def unregister(self, name: str) -> None:
        expected = self.lookup_error(name) or (ModelBusyError if self.ref.state[name] != COLD else None)
        self.call(expected, self.pool.unregister, name)
        if expected is None:
            for table in (self.ref.size, self.ref.state, self.ref.flight, self.ref.loads):
                del table[name]
            self.ref.pinned.discard(name)
            if name in self.ref.lru:
                self.ref.lru.remove(name)

    @rule(name=st.sampled_from(NAMES), size=st.none() | st.integers(0, 50))
    def begin_load(self, name: str, size: int | None) -> None:
        ref = self.ref
        expected = self.lookup_error(name) or (ModelBusyError if ref.state[name] == LOADING else None)
        victims: list[str] | None = []
        if expected is None and ref.state[name] == COLD:
            victims = ref.victims(ref.size[name] if size is None else size, ref.budget)
            expected = NoRoomError if victims is None else None
        planned = self.call(expected, self.pool.plan_admit, name, size)
        evictions = self.call(expected, self.pool.begin_load, name, size)
        if expected is not None:
            return
        assert planned == victims, f"plan_admit said {planned}, the reference {victims}"
        if ref.state[name] == RESIDENT:
            assert evictions == []
            ref.hits += 1
        else:
            assert victims is not None
            assert evictions == ref.drop(victims, "room"), "evictions differ from the reference's LRU order"
            ref.state[name] = LOADING
            ref.size[name] = ref.size[name] if size is None else size
            ref.misses += 1
        ref.touch(name)

    @rule(name=st.sampled_from(NAMES), grow=st.integers(-15, 25))
    def load(self, name: str, grow: int) -> None:
        """begin_load then finish_load in one step, when the model was cold."""
        was_cold = self.ref.state.get(name) == COLD
        self.begin_load(name, None)
        if was_cold and self.ref.state[name] == LOADING:
            self.finish_load(name, grow)

    @rule(name=st.sampled_from(NAMES), grow=st.integers(-15, 25))
    def finish_load(self, name: str, grow: int) -> None:
        ref = self.ref
        if name not in ref.state or ref.state[name] != LOADING:
            self.call(self.lookup_error(name) or ResidencyError, self.pool.finish_load, name, 1, "h")
            return
        actual = max(0, ref.size[name] + grow)
        victims = ref.victims(actual - ref.size[name], ref.budget)
        self.loads_started += 1
        handle = f"{name}#{self.loads_started}"
        if victims is None:
            with pytest.raises(NoRoomError, match="back to cold"):
                self.pool.finish_load(name, actual, handle)
            ref.state[name], ref.size[name] = COLD, actual
            return
        evictions = self.pool.finish_load(name, actual, handle)
        assert evictions == ref.drop(victims, "room"), "evictions differ from the reference's LRU order"
        ref.state[name], ref.size[name], ref.handle[name] = RESIDENT, actual, handle
        ref.loads[name] += 1
        ref.bytes_loaded += actual

    @rule(name=st.sampled_from(NAMES))
    def abort_load(self, name: str) -> None:
        expected = self.lookup_error(name) or (ResidencyError if self.ref.state[name] != LOADING else None)
        self.call(expected, self.pool.abort_load, name)
        if expected is None:
            self.ref.state[name] = COLD

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        expected = self.lookup_error(name) or (ResidencyError if self.ref.state[name] != RESIDENT else None)
        handle = self.call(expected, self.pool.acquire, name)
        if expected is None:
            assert handle == self.ref.handle[name]
            self.ref.flight[name] += 1
            self.ref.touch(name)

    @rule(name=st.sampled_from(NAMES))
    def release(self, name: str) -> None:
        expected = self.lookup_error(name) or (ResidencyError if not self.ref.flight[name] else None)
        self.call(expected, self.pool.release, name)
        if expected is None:
            self.ref.flight[name] -= 1

    @rule(name=st.sampled_from(NAMES), pin=st.booleans())
    def pin(self, name: str, pin: bool) -> None:
        expected = self.lookup_error(name)
        self.call(expected, self.pool.pin if pin else self.pool.unpin, name)
        if expected is None:
            (self.ref.pinned.add if pin else self.ref.pinned.discard)(name)

    @rule(name=st.sampled_from(NAMES), force=st.booleans())
    def evict(self, name: str, force: bool) -> None:
        ref = self.ref
        expected = self.lookup_error(name)
        if expected is None:
            if ref.state[name] == LOADING or ref.flight[name]:
                expected = ModelBusyError
            elif ref.state[name] == COLD:
                expected = ResidencyError
            elif name in ref.pinned and not force:
                expected = PinnedError
        eviction = self.call(expected, self.pool.evict, name, force)
        if expected is None:
            assert [eviction] == ref.drop([name], "explicit")
            if name in ref.pinned:
                self.force_evicted.add(name)

    # Two rules aimed at the states that matter most, which random names reach only now and then.

    @precondition(lambda self: RESIDENT in self.ref.state.values())
    @rule(data=st.data())
    def acquire_a_resident_model(self, data: st.DataObject) -> None:
        names = sorted(n for n, s in self.ref.state.items() if s == RESIDENT)
        self.acquire(data.draw(st.sampled_from(names), label="name"))

    @precondition(lambda self: any(self.ref.flight.values()))
    @rule(data=st.data(), force=st.booleans())
    def evict_a_model_in_flight(self, data: st.DataObject, force: bool) -> None:
        names = sorted(n for n, count in self.ref.flight.items() if count)
        self.evict(data.draw(st.sampled_from(names), label="name"), force)

    @rule(budget=st.integers(0, 150))
    def set_budget(self, budget: int) -> None:
        victims = self.ref.victims(0, budget)
        evictions = self.call(NoRoomError if victims is None else None, self.pool.set_budget, budget)
        if victims is not None:
            assert evictions == self.ref.drop(victims, "budget"), "evictions differ from the reference"
            self.ref.budget = budget

    @invariant()
    def matches_the_reference(self) -> None:
        pool, ref = self.pool, self.ref
        pool.validate()
        assert pool.used_bytes <= pool.budget_bytes == ref.budget
        assert pool.used_bytes == ref.used()
        seen = [(s.name, s.state, s.bytes, s.pinned, s.in_flight, s.loads) for s in pool.snapshot()]
        expected = [
            (n, ref.state[n], ref.size[n], n in ref.pinned, ref.flight[n], ref.loads[n]) for n in ref.size
        ]
        assert seen == expected, "snapshot differs from the reference"
        by_recency = sorted((s for s in pool.snapshot() if s.last_used), key=lambda s: s.last_used)
        assert [s.name for s in by_recency] == ref.lru, "LRU order differs from the reference"
        counters = pool.counters()
        assert (counters.hits, counters.misses) == (ref.hits, ref.misses)
        assert counters.bytes_loaded == ref.bytes_loaded
        assert counters.evictions_by_cause == ref.evictions
        for name, count in ref.flight.items():
            if count:
                assert pool.state(name).state == RESIDENT, f"{name} has {count} in flight but is not resident"
        for name in self.pinned_resident - self.force_evicted:
            assert pool.state(name).state == RESIDENT, f"pinned {name} was dropped without force"
        self.force_evicted.clear()
        self.pinned_resident = {n for n in ref.pinned if ref.state[n] == RESIDENT}


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
