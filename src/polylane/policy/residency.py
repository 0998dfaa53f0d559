"""Which models are in memory under one byte budget: admission, pinning, in-flight counts, LRU.

What this module owns: every registered model's state (cold → loading → resident → cold), the
bytes each one counts against the budget, pins, in-flight request counts, the LRU clock, and the
counters. It holds the runtime's loaded object only as an opaque `handle`, returned in the
`Eviction` that drops it, so the runtime can let go of exactly what was evicted. No I/O, no
threads: `runtime.residency` wraps it in a lock and does the loading.

Rules:
- Used bytes (loading + resident models) never exceed the budget.
- Admission (`begin_load`) is all or nothing: feasibility is decided first; a refused admission
  changes nothing. Room is made by evicting *victims*: resident, unpinned models with no request in
  flight, least recently used first (the LRU clock is a counter advanced by `begin_load` and
  `acquire`; ties cannot happen, each tick touches one model). Pinned models, models in flight and
  models being loaded are never victims.
- Re-admitting a resident model only refreshes its recency (a hit).
- `set_budget` grows without evicting; shrinking evicts victims until the used bytes fit, or is
  refused (budget unchanged) when pinned, in-flight and loading bytes alone exceed it.
- Every operation that evicts returns its `Eviction`s in the order they happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COLD, LOADING, RESIDENT = "cold", "loading", "resident"


class ResidencyError(ValueError):
    """A residency operation was refused; the pool is unchanged."""


class NoRoomError(ResidencyError):
    """The budget cannot hold what was asked without evicting a pinned or busy model."""


class ModelBusyError(ResidencyError):
    """The model has requests in flight (or is loading) and cannot be dropped now."""


class PinnedError(ResidencyError):
    """Explicit eviction of a pinned model without `force`."""


class UnknownModelError(ResidencyError):
    """No model of that name is registered."""


@dataclass(frozen=True)
class Eviction:
    name: str
    bytes: int
    cause: str  # "room" (made room for another model) | "budget" (set_budget) | "explicit"
    handle: object


@dataclass(frozen=True)
class ModelState:
    name: str
    state: str  # cold | loading | resident
    bytes: int  # measured when resident, estimated otherwise
    pinned: bool
    in_flight: int
    last_used: int  # LRU clock value of the last admission or acquire (0: never)
    loads: int


@dataclass(frozen=True)
class ResidencyCounters:
    hits: int  # admissions of a model that was already resident
    misses: int  # admissions that had to load
    evictions: dict[str, int]  # by cause
    bytes_loaded: int
    used_bytes: int
    budget_bytes: int
    pinned_bytes: int  # resident or loading pinned models


@dataclass
class _Model:
    name: str
    bytes: int
    pinned: bool
    order: int
    state: str = COLD
    in_flight: int = 0
    last_used: int = 0
    loads: int = 0
    handle: object = None


@dataclass
class ResidencyPool:
    budget_bytes: int
    _models: dict[str, _Model] = field(default_factory=dict)
    _clock: int = 0
    _hits: int = 0
    _misses: int = 0
    _evictions: dict[str, int] = field(default_factory=lambda: {"room": 0, "budget": 0, "explicit": 0})
    _bytes_loaded: int = 0

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ResidencyError(f"budget must be >= 0 bytes, got {self.budget_bytes}")

    # ------------------------------------------------------------------ registry

    def register(self, name: str, size_bytes: int, pinned: bool = False) -> None:
        if name in self._models:
            raise ResidencyError(f"model {name!r} is already registered")
        if size_bytes < 0:
            raise ResidencyError(f"model {name!r}: size must be >= 0 bytes, got {size_bytes}")
        self._models[name] = _Model(name, size_bytes, pinned, order=len(self._models))

    def unregister(self, name: str) -> None:
        model = self._get(name)
        if model.state != COLD:
            raise ModelBusyError(f"model {name!r} is {model.state}; evict it before unregistering")
        del self._models[name]

    def __contains__(self, name: str) -> bool:
        return name in self._models

    # ------------------------------------------------------------------ admission

    def plan_admit(self, name: str, size_bytes: int | None = None) -> list[str]:
        """The victims admitting `name` would evict, in order; NoRoomError if it cannot fit."""
        model = self._get(name)
        if model.state == RESIDENT:
            return []
        if model.state == LOADING:
            raise ModelBusyError(f"model {name!r} is already loading")
        size = model.bytes if size_bytes is None else size_bytes
        return [victim.name for victim in self._victims_for(size, name, f"load {name!r}")]

    def begin_load(self, name: str, size_bytes: int | None = None) -> list[Eviction]:
        """Reserve `name`'s bytes (evicting LRU victims) and mark it loading; a resident model is
        only touched (a hit) and nothing is evicted."""
        model = self._get(name)
        if model.state == RESIDENT:
            self._hits += 1
            self._touch(model)
            return []
        if model.state == LOADING:
            raise ModelBusyError(f"model {name!r} is already loading")
        size = model.bytes if size_bytes is None else size_bytes
        if size < 0:
            raise ResidencyError(f"model {name!r}: size must be >= 0 bytes, got {size}")
        victims = self._victims_for(size, name, f"load {name!r}")
        evictions = [self._drop(victim, "room") for victim in victims]
        model.bytes, model.state = size, LOADING
        self._misses += 1
        self._touch(model)
        return evictions

    def finish_load(self, name: str, actual_bytes: int, handle: object) -> list[Eviction]:
        """The load succeeded and measured `actual_bytes`. If that is more than reserved and no
        longer fits even after evicting victims, the model reverts to cold and NoRoomError is
        raised (the caller drops its handle); nothing else changes in that case."""
        model = self._get(name)
        if model.state != LOADING:
            raise ResidencyError(f"model {name!r} is {model.state}, not loading")
        extra = actual_bytes - model.bytes
        try:
            victims = self._victims_for(extra, name, f"fit {name!r} as measured ({actual_bytes} bytes)")
        except NoRoomError:
            model.state = COLD
            raise
        evictions = [self._drop(victim, "room") for victim in victims]
        model.bytes, model.state, model.handle = actual_bytes, RESIDENT, handle
        model.loads += 1
        self._bytes_loaded += actual_bytes
        return evictions

    def abort_load(self, name: str) -> None:
        """The load failed: back to cold, its reservation returned."""
        model = self._get(name)
        if model.state != LOADING:
            raise ResidencyError(f"model {name!r} is {model.state}, not loading")
        model.state = COLD

    # ------------------------------------------------------------------ in flight

    def acquire(self, name: str) -> object:
        """One more request in flight on a resident model; returns its handle."""
        model = self._get(name)
        if model.state != RESIDENT:
            raise ResidencyError(f"model {name!r} is {model.state}; load it before acquiring")
        model.in_flight += 1
        self._touch(model)
        return model.handle

    def release(self, name: str) -> None:
        model = self._get(name)
        if model.in_flight == 0:
            raise ResidencyError(f"model {name!r} has no request in flight to release")
        model.in_flight -= 1

    # ------------------------------------------------------------------ pins, evict, budget

    def pin(self, name: str) -> None:
        self._get(name).pinned = True

    def unpin(self, name: str) -> None:
        self._get(name).pinned = False

    def evict(self, name: str, force: bool = False) -> Eviction:
        model = self._get(name)
        if model.state != RESIDENT:
            raise ResidencyError(f"model {name!r} is {model.state}, not resident")
        if model.in_flight:
            raise ModelBusyError(f"model {name!r} has {model.in_flight} requests in flight")
        if model.pinned and not force:
            raise PinnedError(f"model {name!r} is pinned; unpin it or force the eviction")
        return self._drop(model, "explicit")

    def set_budget(self, budget_bytes: int) -> list[Eviction]:
        if budget_bytes < 0:
            raise ResidencyError(f"budget must be >= 0 bytes, got {budget_bytes}")
        victims = self._victims_for(0, None, f"shrink the budget to {budget_bytes}", budget_bytes)
        self.budget_bytes = budget_bytes
        return [self._drop(victim, "budget") for victim in victims]

    # ------------------------------------------------------------------ views

    @property
    def used_bytes(self) -> int:
        return sum(m.bytes for m in self._models.values() if m.state != COLD)

    @property
    def pinned_bytes(self) -> int:
        return sum(m.bytes for m in self._models.values() if m.state != COLD and m.pinned)

    def handle(self, name: str) -> object:
        """The runtime object of a resident model (None otherwise)."""
        return self._get(name).handle

    def state(self, name: str) -> ModelState:
        return self._view(self._get(name))

    def snapshot(self) -> list[ModelState]:
        return [self._view(m) for m in self._models.values()]

    def counters(self) -> ResidencyCounters:
        return ResidencyCounters(
            hits=self._hits,
            misses=self._misses,
            evictions=dict(self._evictions),
            bytes_loaded=self._bytes_loaded,
            used_bytes=self.used_bytes,
            budget_bytes=self.budget_bytes,
            pinned_bytes=self.pinned_bytes,
        )

    def validate(self) -> None:
        if self.used_bytes > self.budget_bytes:
            raise RuntimeError(f"used {self.used_bytes} bytes > budget {self.budget_bytes}")
        for m in self._models.values():
            if m.in_flight and m.state != RESIDENT:
                raise RuntimeError(f"{m.name} has {m.in_flight} in flight but is {m.state}")
            if (m.handle is not None) != (m.state == RESIDENT):
                raise RuntimeError(f"{m.name} is {m.state} with handle {m.handle!r}")

    # ------------------------------------------------------------------ internals

    def _get(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            known = ", ".join(sorted(self._models)) or "none"
            raise UnknownModelError(f"unknown model {name!r}; registered: {known}")
        return model

    def _touch(self, model: _Model) -> None:
        self._clock += 1
        model.last_used = self._clock

    def _victims_for(
        self, needed: int, exclude: str | None, purpose: str, budget: int | None = None
    ) -> list[_Model]:
        """LRU victims to evict so that `needed` more bytes fit under `budget` (default: the current
        one); NoRoomError, naming what holds the memory, if evicting every candidate is not enough."""
        budget = self.budget_bytes if budget is None else budget
        shortfall = self.used_bytes + needed - budget
        if shortfall <= 0:
            return []
        candidates = sorted(
            (
                m
                for m in self._models.values()
                if m.state == RESIDENT and not m.pinned and m.in_flight == 0 and m.name != exclude
            ),
            key=lambda m: (m.last_used, m.order),
        )
        victims, freed = [], 0
        for candidate in candidates:
            if freed >= shortfall:
                break
            victims.append(candidate)
            freed += candidate.bytes
        if freed < shortfall:
            raise NoRoomError(self._no_room_message(needed, purpose, budget, freed, shortfall))
        return victims

    def _no_room_message(self, needed: int, purpose: str, budget: int, freed: int, shortfall: int) -> str:
        held: list[str] = []
        for m in self._models.values():
            if m.state == COLD:
                continue
            if m.pinned:
                why = "pinned"
            elif m.state == LOADING:
                why = "loading"
            elif m.in_flight:
                why = f"{m.in_flight} in flight"
            else:
                continue
            held.append(f"{m.name} ({m.bytes} bytes, {why})")
        return (
            f"cannot {purpose}: needs {needed} bytes, budget {budget}, {self.used_bytes} in use; "
            f"evicting every idle unpinned model frees only {freed} of the {shortfall} short; "
            f"held: {', '.join(held) or 'nothing'}"
        )

    def _drop(self, model: _Model, cause: str) -> Eviction:
        eviction = Eviction(model.name, model.bytes, cause, model.handle)
        model.state, model.handle = COLD, None
        self._evictions[cause] += 1
        return eviction

    @staticmethod
    def _view(model: _Model) -> ModelState:
        return ModelState(
            model.name, model.state, model.bytes, model.pinned, model.in_flight, model.last_used, model.loads
        )

