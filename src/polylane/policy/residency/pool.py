"""Which models are in memory under one byte budget: admission, pinning, in-flight counts, eviction.

What this module owns: every registered model's state (cold → loading → resident → cold), the
bytes each one counts against the budget, pins, in-flight request counts, the LRU clock, the
eviction priorities, and the counters. It holds the runtime's loaded object only as an opaque
`handle`, and gives it back in the `Eviction` that drops the model, so the runtime can let go of
exactly what was evicted. What it does not own: loading, bytes in memory, files, time. No I/O, no
threads, no torch: `runtime.residency.manager` wraps every call in one lock and does the loading between
`begin_load` and `finish_load` (or `abort_load`).

States. *cold*: registered, not in memory, counts nothing. *loading*: `begin_load` reserved its
bytes (counted as used) and the runtime is loading it. *resident*: in memory with its measured bytes
and its handle. `bytes` is the estimate given at `register`/`begin_load` until `finish_load`
measures it.

Rules:
- Used bytes (loading + resident models) never exceed the budget.
- *Victims* are resident, unpinned models with no request in flight. Loading models, pinned models
  and models in flight are never evicted to make room, nor by `set_budget`.
- Victim order depends on the pool's `eviction` policy (below). Victims are taken in that order
  until enough bytes are free: an earlier victim is never skipped to spare a bigger one.
- All or nothing: feasibility is decided before anything changes; an operation that raises a
  `ResidencyError` leaves the pool as it was. The one documented exception is `finish_load` when
  the measured model cannot fit: the model goes back to cold (its reservation returned) and then
  NoRoomError is raised, so the runtime must drop the handle it was about to hand over.
- Re-admitting (`begin_load`) a resident model only refreshes its recency and counts a hit.
- `set_budget` grows without evicting; a shrink evicts victims until the used bytes fit, or is
  refused (budget unchanged) when pinned, in-flight and loading bytes alone exceed it.
- Every operation that evicts returns its `Eviction`s in the order they happened.

Eviction policies (`ResidencyPool(budget, eviction=...)`):
- "lru" (the default): least recently used first, by `last_used` (a logical clock advanced by one
  on every `begin_load` and `acquire`, never wall time), ties broken by registration order (earlier
  first). Each tick stamps one model, so two models that were ever admitted never tie; the
  tie-break only keeps the order total.
- "cost": cost-aware, GreedyDual-Size-Frequency (Cherkasova 1998). Every touch (`begin_load`,
  `acquire`) sets the model's priority H = L + frequency × reload_seconds / bytes; victims go
  lowest H first, ties by `last_used` then registration order. `frequency` is the number of
  `begin_load`s since the model was last loaded (1 on the miss that loads it, +1 per hit). L (the
  `inflation`, starting at 0) is raised to the H of every model evicted for room or budget (never
  lowered, and not raised by an explicit `evict`), so models not touched for a while age: a fresh
  touch outbids whatever was evicted before it. Why this rule: a miss costs the time to load the
  model again, and a model occupies its bytes; H ranks models by the reload seconds they save per
  byte they hold, which is what an eviction under a byte budget should keep high (a knapsack's
  value density). `reload_seconds` is given at `register` or by `set_reload_cost` (the runtime feeds
  each measured load time); until one is known the model is assumed to reload at
  `DEFAULT_RELOAD_BYTES_PER_SECOND`. A new cost takes effect at the model's next touch. When every
  model reloads at the same bytes per second and is used once per load, this is LRU; with
  frequencies it keeps a popular small model that is slow to reload (per byte) where LRU would
  drop it.

Hits and misses are counted by `begin_load` only (on a resident model: a hit; on a cold one: a
miss). `acquire` does not count: the runtime calls `begin_load` and then `acquire` for every
request, so counting both would count each request twice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from polylane.policy.residency.eviction import DEFAULT_EVICTION, EVICTION_POLICIES

COLD, LOADING, RESIDENT = "cold", "loading", "resident"
CAUSES = ("room", "budget", "explicit")
DEFAULT_RELOAD_BYTES_PER_SECOND = 1e9  # "cost" eviction: the assumed reload speed until one is measured


class ResidencyError(ValueError):
    """A residency operation was refused; the pool is unchanged (but see `finish_load`)."""


class NoRoomError(ResidencyError):
    """The budget cannot hold what was asked without evicting a pinned, busy or loading model."""


class ModelBusyError(ResidencyError):
    """The model has requests in flight (or is loading) and cannot be dropped or reloaded now."""


class PinnedError(ResidencyError):
    """Explicit eviction of a pinned model without `force`."""


class UnknownModelError(ResidencyError, LookupError):
    """A name that is none of the models here (the residency pool's, and so a request's or an admin
    route's: the engine raises this one too); the message lists the names that are."""

    def __init__(self, model: str, known: Sequence[str]) -> None:
        self.model, self.served = model, tuple(known)
        super().__init__(f"model {model!r} is not served here (served: {', '.join(self.served) or 'none'})")


@dataclass(frozen=True)
class Eviction:
    """One model dropped to cold. The runtime drops `handle` (what it passed to `finish_load`)."""

    name: str
    bytes: int
    cause: str  # "room" (made room for another model) | "budget" (set_budget) | "explicit" (evict)
    handle: object


@dataclass(frozen=True)
class ModelState:
    """One model as `snapshot()` sees it."""

    name: str
    state: str  # cold | loading | resident
    bytes: int  # measured once loaded (also after a failed finish_load), estimated before
    pinned: bool
    in_flight: int  # requests holding it (acquire minus release)
    last_used: int  # LRU clock at the last begin_load or acquire (0: never)
    loads: int  # finished loads
    reload_seconds: float | None = None  # the cost of loading it again (None: not known yet)
    frequency: int = 0  # "cost" eviction: begin_loads since it was last loaded (0: never admitted)
    priority: float = 0.0  # "cost" eviction: H at its last touch (victims lowest first); 0.0 for "lru"


@dataclass(frozen=True)
class ResidencyCounters:
    """Counters since the pool was made, and the byte totals now.

    hits / misses: `begin_load` of a resident / a cold model. evictions_by_cause: evictions per
    cause ("room", "budget", "explicit"). bytes_loaded: sum of the measured bytes of every finished
    load. used_bytes: loading + resident bytes. pinned_bytes: of those, the pinned models' bytes.
    """

    hits: int
    misses: int
    evictions_by_cause: dict[str, int]
    bytes_loaded: int
    used_bytes: int
    budget_bytes: int
    pinned_bytes: int

    @property
    def evictions(self) -> dict[str, int]:
        """Same as `evictions_by_cause` (the field's first name)."""
        return self.evictions_by_cause

    @property
    def num_evictions(self) -> int:
        return sum(self.evictions_by_cause.values())

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any admission."""
        admissions = self.hits + self.misses
        return self.hits / admissions if admissions else 0.0


@dataclass(eq=False)
class _Model:
    name: str
    bytes: int
    pinned: bool
    order: int  # registration serial: the LRU tie-break, never reused
    state: str = COLD
    in_flight: int = 0
    last_used: int = 0
    loads: int = 0
    handle: object = None
    reload_seconds: float | None = None
    frequency: int = 0
    priority: float = 0.0


def _checked_bytes(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ResidencyError(f"{what} must be a whole number of bytes, got {value!r}")
    if value < 0:
        raise ResidencyError(f"{what} must be >= 0 bytes, got {value}")
    return value


def _checked_seconds(what: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ResidencyError(f"{what} must be a finite number of seconds or None, got {value!r}")
    if value < 0:
        raise ResidencyError(f"{what} must be >= 0 seconds, got {value}")
    return float(value)


class ResidencyPool:
    """Models under one byte budget: all-or-nothing admission, LRU or cost-aware eviction, pins,
    in-flight counts.

    Not thread-safe: the runtime holds one lock around every call.
    """

    def __init__(self, budget_bytes: int, eviction: str = DEFAULT_EVICTION) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ResidencyError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}; got {eviction!r}")
        self._policy = EVICTION_POLICIES[eviction]
        self._inflation = 0.0  # "cost" eviction: L, the highest H of a model evicted for room or budget
        self._budget_bytes = _checked_bytes("budget", budget_bytes)
        self._models: dict[str, _Model] = {}
        self._registrations = itertools.count()
        self._clock = 0
        self._used_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = dict.fromkeys(CAUSES, 0)
        self._bytes_loaded = 0

    # ------------------------------------------------------------------ registry

    def register(
        self, name: str, size_bytes: int, pinned: bool = False, reload_seconds: float | None = None
    ) -> None:
        """Declare a cold model with an estimated size (`begin_load` may correct it) and, for "cost"
        eviction, the seconds it takes to load (None: not known yet; see `set_reload_cost`)."""
        if not isinstance(name, str) or not name:
            raise ResidencyError(f"a model name must be a non-empty string, got {name!r}")
        if name in self._models:
            raise ResidencyError(f"model {name!r} is already registered ({self._models[name].state})")
        size = _checked_bytes(f"model {name!r}: size", size_bytes)
        seconds = _checked_seconds(f"model {name!r}: reload cost", reload_seconds)
        model = _Model(name, size, bool(pinned), order=next(self._registrations), reload_seconds=seconds)
        self._models[name] = model

    def set_reload_cost(self, name: str, seconds: float | None) -> None:
        """Set how many seconds loading `name` again takes (the runtime passes each measured load
        time; None: unknown again). Used by "cost" eviction from the model's next touch on; any
        state, nothing is evicted."""
        model = self._get(name)
        model.reload_seconds = _checked_seconds(f"model {name!r}: reload cost", seconds)

    def unregister(self, name: str) -> None:
        """Forget a cold model (its counters stay in the pool's totals)."""
        model = self._get(name)
        if model.state != COLD:
            raise ModelBusyError(f"model {name!r} is {model.state}; evict it before unregistering")
        del self._models[name]

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __len__(self) -> int:
        return len(self._models)

    # ------------------------------------------------------------------ admission

    def plan_admit(self, name: str, size_bytes: int | None = None) -> list[str]:
        """The victims `begin_load(name, size_bytes)` would evict, in eviction order; changes nothing.

        A resident model needs no room ([]); a loading one raises ModelBusyError; NoRoomError if it
        cannot fit even after evicting every victim.
        """
        model, size = self._admission(name, size_bytes)
        if model.state == RESIDENT:
            return []
        return [victim.name for victim in self._victims_for_load(model, size)]

    def begin_load(self, name: str, size_bytes: int | None = None) -> list[Eviction]:
        """Admit a cold model: evict victims until `size_bytes` (default: its registered size)
        fits, reserve it and mark it loading; the runtime then loads it and calls `finish_load` or
        `abort_load`. A refused admission (NoRoomError) evicts nothing and changes nothing.

        A resident model is only touched (a hit; `size_bytes` is ignored: its measured size stands)
        and nothing is evicted. A loading model raises ModelBusyError.
        """
        model, size = self._admission(name, size_bytes)
        if model.state == RESIDENT:
            self._hits += 1
            model.frequency += 1
            self._touch(model)
            return []
        victims = self._victims_for_load(model, size)
        evictions = [self._drop(victim, "room") for victim in victims]
        model.bytes, model.state = size, LOADING
        self._used_bytes += size
        self._misses += 1
        model.frequency = 1
        self._touch(model)
        return evictions

    def finish_load(self, name: str, actual_bytes: int, handle: object) -> list[Eviction]:
        """The load succeeded: `name` becomes resident with its measured `actual_bytes` and `handle`
        (the runtime's loaded object, not None; given back in the `Eviction` that drops it).

        A measured size above the reservation may evict more victims (returned, in order). If
        it cannot fit even then, the model goes back to cold (reservation returned, the measured
        size kept as its estimate, nothing else changed) and NoRoomError is raised: the caller must
        then drop `handle` itself, the pool never held it.
        """
        model = self._get(name)
        if model.state != LOADING:
            raise ResidencyError(f"model {name!r} is {model.state}, not loading; call begin_load first")
        actual = _checked_bytes(f"model {name!r}: measured size", actual_bytes)
        if handle is None:
            raise ResidencyError(f"model {name!r}: finish_load needs the loaded object as handle, got None")
        extra = actual - model.bytes
        victims = self._victims_for(extra, self._budget_bytes)
        if victims is None:
            message = self._no_room_message(
                f"cannot keep model {name!r} as measured ({actual} bytes, {model.bytes} reserved)",
                extra,
                self._budget_bytes,
                subject=model,
            )
            self._used_bytes -= model.bytes
            model.state, model.bytes = COLD, actual
            raise NoRoomError(f"{message}; {name!r} is back to cold, drop its handle")
        evictions = [self._drop(victim, "room") for victim in victims]
        self._used_bytes += extra
        model.bytes, model.state, model.handle = actual, RESIDENT, handle
        model.loads += 1
        self._bytes_loaded += actual
        return evictions

    def abort_load(self, name: str) -> None:
        """The load failed: back to cold, its reservation returned; nothing else changes (models
        evicted by `begin_load` stay evicted, and the miss stays counted)."""
        model = self._get(name)
        if model.state != LOADING:
            raise ResidencyError(f"model {name!r} is {model.state}, not loading")
        self._used_bytes -= model.bytes
        model.state = COLD

    # ------------------------------------------------------------------ in flight

    def acquire(self, name: str) -> object:
        """One more request in flight on a resident model (refreshes its recency); returns its
        handle. The runtime admits it first (`begin_load`); acquire never loads."""
        model = self._get(name)
        if model.state != RESIDENT:
            hint = "it is still loading" if model.state == LOADING else "admit it with begin_load first"
            raise ResidencyError(f"model {name!r} is {model.state}, not resident: {hint}")
        model.in_flight += 1
        self._touch(model)
        return model.handle

    def release(self, name: str) -> None:
        """One request fewer in flight; once at zero the model can be evicted again."""
        model = self._get(name)
        if model.in_flight == 0:
            raise ResidencyError(f"model {name!r} has no request in flight to release")
        model.in_flight -= 1

    # ------------------------------------------------------------------ pins, evict, budget

    def pin(self, name: str) -> None:
        """Never evict `name` for room or budget. Works in any state (a cold model is pinned once
        loaded). Pinning does not load."""
        self._get(name).pinned = True

    def unpin(self, name: str) -> None:
        self._get(name).pinned = False

    def evict(self, name: str, force: bool = False) -> Eviction:
        """Drop a resident model now. Refused for a model in flight (ModelBusyError, even with
        `force`), a pinned one without `force` (PinnedError), and one that is not resident."""
        model = self._get(name)
        if model.state == LOADING:
            raise ModelBusyError(f"model {name!r} is loading; finish_load or abort_load it first")
        if model.state != RESIDENT:
            raise ResidencyError(f"model {name!r} is {model.state}, not resident")
        if model.in_flight:
            raise ModelBusyError(f"model {name!r} has {model.in_flight} requests in flight")
        if model.pinned and not force:
            raise PinnedError(f"model {name!r} is pinned; unpin it or force the eviction")
        return self._drop(model, "explicit")

    def set_budget(self, budget_bytes: int) -> list[Eviction]:
        """Change the budget. Growing evicts nothing; shrinking evicts victims until the used
        bytes fit (cause "budget"), or raises NoRoomError with the pool (budget included) unchanged
        when pinned, in-flight and loading bytes alone exceed the new budget."""
        budget = _checked_bytes("budget", budget_bytes)
        victims = self._victims_for(0, budget)
        if victims is None:
            lead = f"cannot shrink the budget from {self._budget_bytes} to {budget} bytes"
            raise NoRoomError(self._no_room_message(lead, 0, budget))
        self._budget_bytes = budget
        return [self._drop(victim, "budget") for victim in victims]

    # ------------------------------------------------------------------ views

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of loading and resident models."""
        return self._used_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned models that are loading or resident."""
        return sum(m.bytes for m in self._models.values() if m.state != COLD and m.pinned)

    @property
    def eviction(self) -> str:
        """The eviction policy's name (`policy/residency/eviction.py`: "lru" or "cost")."""
        return self._policy.name

    @property
    def inflation(self) -> float:
        """L of "cost" eviction: the highest priority of a model evicted for room or budget (0.0 at
        first, and always under "lru")."""
        return self._inflation

    @property
    def clock(self) -> int:
        """The LRU clock: the number of `begin_load` and `acquire` calls that succeeded."""
        return self._clock

    def handle(self, name: str) -> object:
        """The runtime object of a resident model (None otherwise)."""
        return self._get(name).handle

    def state(self, name: str) -> ModelState:
        return self._view(self._get(name))

    def snapshot(self) -> list[ModelState]:
        """Every model, in registration order."""
        return [self._view(m) for m in self._models.values()]

    def counters(self) -> ResidencyCounters:
        return ResidencyCounters(
            hits=self._hits,
            misses=self._misses,
            evictions_by_cause=dict(self._evictions),
            bytes_loaded=self._bytes_loaded,
            used_bytes=self._used_bytes,
            budget_bytes=self._budget_bytes,
            pinned_bytes=self.pinned_bytes,
        )

    def validate(self) -> None:
        """Check the pool's invariants; raise RuntimeError naming the first broken one.

        For tests and debugging: cost is linear in the number of models.
        """
        in_memory = [m for m in self._models.values() if m.state != COLD]
        counted = sum(m.bytes for m in in_memory)
        if counted != self._used_bytes:
            raise RuntimeError(f"used-bytes counter says {self._used_bytes}, models in memory hold {counted}")
        if self._used_bytes > self._budget_bytes:
            raise RuntimeError(f"used {self._used_bytes} bytes > budget {self._budget_bytes}")
        for m in self._models.values():
            if m.state not in (COLD, LOADING, RESIDENT):
                raise RuntimeError(f"{m.name} is in unknown state {m.state!r}")
            if m.bytes < 0 or m.in_flight < 0:
                raise RuntimeError(f"{m.name} has {m.bytes} bytes and {m.in_flight} in flight")
            if m.in_flight and m.state != RESIDENT:
                raise RuntimeError(f"{m.name} has {m.in_flight} in flight but is {m.state}")
            if (m.handle is not None) != (m.state == RESIDENT):
                raise RuntimeError(f"{m.name} is {m.state} with handle {m.handle!r}")
            if not 0 <= m.last_used <= self._clock or (m.state != COLD and m.last_used == 0):
                raise RuntimeError(f"{m.name} ({m.state}) last used at {m.last_used}, clock {self._clock}")
            cost = m.reload_seconds
            if cost is not None and not (math.isfinite(cost) and cost >= 0):
                raise RuntimeError(f"{m.name} has reload cost {m.reload_seconds!r}")
            if m.frequency < 0 or (m.state != COLD and m.frequency == 0):
                raise RuntimeError(f"{m.name} ({m.state}) has frequency {m.frequency}")
            if not (math.isfinite(m.priority) and m.priority >= 0):
                raise RuntimeError(f"{m.name} has priority {m.priority!r}")
        if not (math.isfinite(self._inflation) and self._inflation >= 0):
            raise RuntimeError(f"inflation is {self._inflation!r}")
        if not self._policy.inflates and self._inflation != 0.0:
            raise RuntimeError(f"inflation is {self._inflation} under {self._policy.name} eviction")
        stamps = [m.last_used for m in in_memory]
        if len(set(stamps)) != len(stamps):
            raise RuntimeError(f"models in memory share LRU stamps: {sorted(stamps)}")
        orders = [m.order for m in self._models.values()]
        if orders != sorted(set(orders)):
            raise RuntimeError(f"registration serials are not increasing and distinct: {orders}")
        if set(self._evictions) != set(CAUSES) or min(self._evictions.values()) < 0:
            raise RuntimeError(f"eviction counters {self._evictions}")
        if sum(m.loads for m in self._models.values()) > self._misses:
            raise RuntimeError(f"more finished loads than misses ({self._misses})")

    # ------------------------------------------------------------------ internals

    def _get(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            raise UnknownModelError(name, list(self._models))
        return model

    def _admission(self, name: str, size_bytes: int | None) -> tuple[_Model, int]:
        """The model and the size to admit it at; refuses a loading model and a bad size."""
        model = self._get(name)
        if model.state == LOADING:
            raise ModelBusyError(f"model {name!r} is already loading")
        size = model.bytes if size_bytes is None else _checked_bytes(f"model {name!r}: size", size_bytes)
        return model, size

    def _victims_for_load(self, model: _Model, size: int) -> list[_Model]:
        victims = self._victims_for(size, self._budget_bytes)
        if victims is None:
            lead = f"cannot load model {model.name!r} ({size} bytes)"
            if size > self._budget_bytes:
                lead += ", larger than the whole budget"
            raise NoRoomError(self._no_room_message(lead, size, self._budget_bytes, subject=model))
        return victims

    def _touch(self, model: _Model) -> None:
        self._clock += 1
        model.last_used = self._clock
        model.priority = self._policy.priority(
            self._inflation, model.frequency, self._seconds_per_byte(model)
        )

    @staticmethod
    def _seconds_per_byte(model: _Model) -> float:
        if model.reload_seconds is None:
            return 1.0 / DEFAULT_RELOAD_BYTES_PER_SECOND
        return model.reload_seconds / max(model.bytes, 1)

    def _candidates(self) -> list[_Model]:
        """Victims in eviction order: idle unpinned resident models, lowest rank first (the policy's)."""
        idle = (m for m in self._models.values() if m.state == RESIDENT and not m.pinned and not m.in_flight)
        return sorted(idle, key=lambda m: self._policy.rank(m.priority, m.last_used, m.order))

    def _victims_for(self, needed: int, budget: int) -> list[_Model] | None:
        """The victims to evict, in order, so that `needed` more bytes (may be <= 0) fit under
        `budget`; None if evicting every candidate is not enough. Changes nothing."""
        shortfall = self._used_bytes + needed - budget
        victims: list[_Model] = []
        freed = 0
        for candidate in self._candidates():
            if freed >= shortfall:
                break
            victims.append(candidate)
            freed += candidate.bytes
        return victims if freed >= shortfall else None

    def _no_room_message(self, lead: str, needed: int, budget: int, subject: _Model | None = None) -> str:
        shortfall = self._used_bytes + needed - budget
        freeable = sum(m.bytes for m in self._candidates())
        held: list[str] = []
        for m in self._models.values():
            if m.state == COLD or m is subject:
                continue
            reasons = []
            if m.pinned:
                reasons.append("pinned")
            if m.state == LOADING:
                reasons.append("loading")
            if m.in_flight:
                reasons.append(f"{m.in_flight} in flight")
            if reasons:
                held.append(f"{m.name} ({m.bytes} bytes, {', '.join(reasons)})")
        return (
            f"{lead}: budget {budget} bytes, {self._used_bytes} in use, {shortfall} short; evicting every "
            f"idle unpinned resident model frees only {freeable}; held: {', '.join(held) or 'nothing'}"
        )

    def _drop(self, model: _Model, cause: str) -> Eviction:
        eviction = Eviction(model.name, model.bytes, cause, model.handle)
        if self._policy.inflates and cause != "explicit":
            self._inflation = max(self._inflation, model.priority)
        self._used_bytes -= model.bytes
        model.state, model.handle = COLD, None
        self._evictions[cause] += 1
        return eviction

    @staticmethod
    def _view(model: _Model) -> ModelState:
        return ModelState(
            model.name,
            model.state,
            model.bytes,
            model.pinned,
            model.in_flight,
            model.last_used,
            model.loads,
            model.reload_seconds,
            model.frequency,
            model.priority,
        )
