"""What speculation costs, as measured: the target's forward by token count, and each drafter's.

What this module owns: the measured side of the speculation controller's cost model, kept per
target for as long as the engine serves it (a target whose lease is let go between requests and
taken again keeps what it measured; see `runtime.speculation.setup`). Pure policy: floats, no clocks.

- `CostTable`: the target's forward seconds by the tokens it computes, t(n). A forward's cost is
  not a line in n: a native decoder may run small batches and hand larger ones to torch (a jump
  in cost at that size), and kernels tile tokens in groups (steps). So every token count keeps its
  own measured mean, and a count not yet measured is predicted from its measured neighbours,
  optimistically (so that the controller tries it once and then knows).
- `SpecMeasurements`: that table, plus per drafter its seconds per draft forward and per token of
  a prompt catch-up, and per (drafter, shape) the tokens a round realised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polylane.policy.speculation.tree import TreeShape


class Ema:
    """An exponentially decayed mean: each new value weighs `1 - decay`, and early values are
    not biased towards the start (the weights are normalised)."""

    __slots__ = ("decay", "total", "weight")

    def __init__(self, decay: float = 0.98) -> None:
        self.decay, self.total, self.weight = decay, 0.0, 0.0

    def add(self, value: float, count: float = 1.0) -> None:
        keep = self.decay**count
        self.total = self.total * keep + value * (1 - keep)
        self.weight = self.weight * keep + (1 - keep)

    @property
    def seen(self) -> bool:
        return self.weight > 0

    def value(self, default: float = 0.0) -> float:
        return self.total / self.weight if self.weight > 0 else default


@dataclass
class CostTable:
    """The target's forward seconds by tokens computed: a measured mean per token count.

    A count's first forward is dropped (a new shape pays one-off costs: kernel selection,
    allocation). Predictions assume that cost never falls as the count grows: a measured mean
    above a larger count's is taken down to it (one slow forward must not bar a size for good).
    A count never measured, between measured counts a < n < b, is predicted as the smaller of the
    straight line from t(a) to t(b) and t(a) plus the prior slope per token (optimistic: a jump
    may lie anywhere past a, and trying n once settles it); above every measured count, t(a) plus
    the prior slope; below every one, t(b) scaled down by it. The prior slope is
    `prior_slope_share` of the smallest measured count's cost per token.
    """

    decay: float = 0.9
    prior_slope_share: float = 0.05
    means: dict[int, Ema] = field(default_factory=dict)
    warmed: set[int] = field(default_factory=set)
    _envelope: list[tuple[int, float]] | None = field(default=None, repr=False, compare=False)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens not in self.warmed:
            self.warmed.add(tokens)
            return
        self.means.setdefault(tokens, Ema(self.decay)).add(seconds)
        self._envelope = None

    @property
    def seen(self) -> bool:
        return bool(self.means)

    def measured(self, tokens: int) -> bool:
        """Whether forwards over exactly this many tokens have been measured (past warm-up)."""
        return tokens in self.means

    def envelope(self) -> list[tuple[int, float]]:
        """(count, seconds) of every measured count, ascending, each at most any larger count's."""
        if self._envelope is None:
            points = sorted((n, ema.value()) for n, ema in self.means.items())
            running = float("inf")
            for i in range(len(points) - 1, -1, -1):
                running = min(running, points[i][1])
                points[i] = (points[i][0], running)
            self._envelope = points
        return self._envelope

    def predict(self, tokens: int) -> float:
        points = self.envelope()
        if not points:
            return 0.0
        step = self.prior_slope_share * points[0][1]
        below = next((p for p in reversed(points) if p[0] <= tokens), None)
        above = next((p for p in points if p[0] >= tokens), None)
        if below is None:
            assert above is not None
            return above[1] / (1 + self.prior_slope_share * (above[0] - tokens))
        if below[0] == tokens:
            return below[1]
        optimistic = below[1] + step * (tokens - below[0])
        if above is None:
            return optimistic
        line = below[1] + (above[1] - below[1]) * (tokens - below[0]) / (above[0] - below[0])
        return min(optimistic, line)


@dataclass
class SpecMeasurements:
    """Everything a target's controller measured, kept across reloads of the target.

    verify: the target's forward seconds by tokens (plain decode steps and verify passes).
    draft: per drafter, seconds per draft forward (one depth, a batch).
    draft_prefill: per drafter, seconds per token of a request's catch-up prefill.
    shape_tokens: per (drafter, shape), the tokens a round realised.
    """

    verify: CostTable = field(default_factory=CostTable)
    draft: dict[str, Ema] = field(default_factory=dict)
    draft_prefill: dict[str, Ema] = field(default_factory=dict)
    shape_tokens: dict[tuple[str, TreeShape], Ema] = field(default_factory=dict)

    def add_drafter(self, name: str) -> None:
        self.draft.setdefault(name, Ema(0.95))
        self.draft_prefill.setdefault(name, Ema(0.9))


__all__ = ["CostTable", "Ema", "SpecMeasurements"]
