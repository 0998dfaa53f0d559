"""Eviction policies: which idle resident model goes first when the budget needs room.

What this module owns: the `EvictionPolicy` seam that `ResidencyPool` asks (the priority a touch
gives a model, the order victims are taken in, whether an eviction ages the others) and the
registry of policies by name, which the pool, `EngineConfig`, the server config and
`polylane serve --eviction` all read. A new policy is one class here and one entry in
`EVICTION_POLICIES`. The rules of "lru" and "cost" are in `policy/residency/pool.py`'s docstring.
"""

from __future__ import annotations

from typing import Protocol


class EvictionPolicy(Protocol):
    """How `ResidencyPool` ranks idle resident models for eviction, lowest rank first."""

    name: str
    # An eviction for room or budget raises the pool's inflation L to the victim's priority.
    inflates: bool

    def priority(self, inflation: float, frequency: int, seconds_per_byte: float) -> float:
        """The priority a touch (`begin_load`, `acquire`) gives a model: L, the begin_loads since it
        was last loaded, and the seconds per byte it takes to load again."""
        ...

    def rank(self, priority: float, last_used: int, order: int) -> tuple[float | int, ...]:
        """The sort key of an idle model (lowest evicted first): its priority, its last touch on
        the pool's logical clock, its registration serial (unique, so the order is total)."""
        ...


class LeastRecentlyUsed:
    """ "lru": least recently used first (ties by registration order); priorities stay 0."""

    name = "lru"
    inflates = False

    def priority(self, inflation: float, frequency: int, seconds_per_byte: float) -> float:
        return 0.0

    def rank(self, priority: float, last_used: int, order: int) -> tuple[float | int, ...]:
        return (last_used, order)


class CostAware:
    """ "cost": GreedyDual-Size-Frequency, H = L + frequency × reload seconds per byte; lowest H
    first, ties by recency."""

    name = "cost"
    inflates = True

    def priority(self, inflation: float, frequency: int, seconds_per_byte: float) -> float:
        return inflation + frequency * seconds_per_byte

    def rank(self, priority: float, last_used: int, order: int) -> tuple[float | int, ...]:
        return (priority, last_used, order)


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    policy.name: policy for policy in (LeastRecentlyUsed(), CostAware())
}
DEFAULT_EVICTION = "lru"
