"""Who owns the decode lane: lane policies, and the monitor that counts models decoding at once.

What this module owns: the choice, each step, of the one model whose running requests decode
together, among the models that have requests ready to decode; and `LaneMonitor`, the real
counter of models inside a decode step at the same instant (the lane invariant, observed).

Policies see one `LaneCandidate` per model with requests ready to decode:
- `fcfs`: the model holding the oldest waiting token (the request whose last token came
  earliest); ties by registration order. A model that just decoded has the newest tokens, so
  models alternate step by step: fairest TPOT, most switches.
- `round-robin`: the next model after the current owner in registration order.
- `priority`: the highest request priority; a waiting model ages one level per `aging_steps`
  steps, so a low-priority model waits at most (priority gap + 1) × aging_steps steps, plus one
  step for each model beyond two (models of equal age and priority take turns ahead of it).
- `throughput`: the owner keeps the lane for `quantum` steps while it has work, then it goes to
  the fcfs choice among the others. Fewer switches; a model waits at most quantum × (models − 1).
Every policy is a pure function of the candidates and the lane's recent history.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class LaneCandidate:
    model: str
    order: int  # registration order of the model (the deterministic tie-break)
    oldest_ready_step: int  # the step at which its longest-waiting request got its last token
    priority: int  # the highest priority among its ready requests


@dataclass(frozen=True)
class LaneOwner:
    """The model that owned the lane at the last decode step, and for how many steps in a row."""

    model: str | None = None
    order: int = -1
    held: int = 0


class LaneRule(Protocol):
    """A lane policy: the lane owner for this step, from the candidates (never empty), the last
    owner, the step number and the policy's settings (`quantum`, `aging_steps`)."""

    def __call__(
        self, candidates: list[LaneCandidate], owner: LaneOwner, step: int, settings: LanePolicy
    ) -> str: ...


def _oldest(candidates: list[LaneCandidate]) -> str:
    return min(candidates, key=lambda c: (c.oldest_ready_step, c.order)).model


def _fcfs(candidates: list[LaneCandidate], owner: LaneOwner, step: int, settings: LanePolicy) -> str:
    return _oldest(candidates)


def _round_robin(candidates: list[LaneCandidate], owner: LaneOwner, step: int, settings: LanePolicy) -> str:
    if owner.model is None:
        return _oldest(candidates)
    ordered = sorted(candidates, key=lambda c: c.order)
    later = [c for c in ordered if c.order > owner.order]
    return (later or ordered)[0].model


def _priority(candidates: list[LaneCandidate], owner: LaneOwner, step: int, settings: LanePolicy) -> str:
    def rank(c: LaneCandidate) -> tuple[int, int, int]:
        return (
            c.priority + (step - c.oldest_ready_step) // settings.aging_steps,
            -c.oldest_ready_step,
            -c.order,
        )

    return max(candidates, key=rank).model


def _throughput(candidates: list[LaneCandidate], owner: LaneOwner, step: int, settings: LanePolicy) -> str:
    others = [c for c in candidates if c.model != owner.model]
    owner_ready = owner.model is not None and len(others) < len(candidates)
    if owner_ready and (owner.held < settings.quantum or not others):
        return owner.model  # type: ignore[return-value]
    return _oldest(others)


# The lane policies by name (the module docstring has their rules): a new policy is one function
# and one entry here; SchedulerConfig, the server config and `serve --lane-policy` read this.
LANE_POLICIES: dict[str, LaneRule] = {
    "fcfs": _fcfs,
    "round-robin": _round_robin,
    "priority": _priority,
    "throughput": _throughput,
}


class LanePolicy:
    """Pick the lane owner for this step; `current` owned the lane for `held` steps in a row."""

    def __init__(self, name: str = "throughput", *, quantum: int = 4, aging_steps: int = 8) -> None:
        if name not in LANE_POLICIES:
            raise ValueError(f"unknown lane policy {name!r} (choose from {', '.join(LANE_POLICIES)})")
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        if aging_steps < 1:
            raise ValueError(f"aging_steps must be >= 1, got {aging_steps}")
        self.name = name
        self.quantum = quantum
        self.aging_steps = aging_steps
        self._rule = LANE_POLICIES[name]

    def choose(self, candidates: list[LaneCandidate], owner: LaneOwner, step: int) -> str:
        if not candidates:
            raise ValueError("no model has requests ready to decode")
        return self._rule(candidates, owner, step, self)


@dataclass
class LaneMonitor:
    """Counts the models inside a decode step at this instant, and the most ever seen at once.

    The runner calls `enter(model)` before a forward pass that decodes for `model` and `exit`
    after it (a drafter's steps enter as `drafter@target` inside their target's slot). Thread-safe:
    a second model entering while another is inside is recorded, not prevented, so a broken
    scheduler shows up in `max_concurrent` instead of being hidden.
    """

    inside: dict[str, int] = field(default_factory=dict)
    max_concurrent: int = 0
    max_concurrent_drafters: int = 0
    decode_steps: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def enter(self, model: str) -> None:
        with self._lock:
            self.inside[model] = self.inside.get(model, 0) + 1
            targets = {name.split("@")[-1] for name in self.inside}
            drafters = sum(1 for name in self.inside if "@" in name)
            self.max_concurrent = max(self.max_concurrent, len(targets))
            self.max_concurrent_drafters = max(self.max_concurrent_drafters, drafters)
            if "@" not in model:
                self.decode_steps += 1

    def exit(self, model: str) -> None:
        with self._lock:
            count = self.inside.get(model, 0)
            if count <= 0:
                raise RuntimeError(f"lane monitor: {model!r} exits a decode step it never entered")
            if count == 1:
                del self.inside[model]
            else:
                self.inside[model] = count - 1

    @property
    def current(self) -> int:
        with self._lock:
            return len({name.split("@")[-1] for name in self.inside})
