"""How many threads the engine computes with, given how busy the machine is with other work.

What this module owns: the decision, from CPU-time samples, of the thread count for the next
steps. It reads nothing and sets nothing (`runtime/cpu_load.py` samples the machine, the engine
applies the count); no torch, no clocks of its own.

Why: the engine's parallel ops (torch's and the native stack's OpenMP teams) split each op evenly
over their threads and wait for the slowest at the end of every op, a few hundred times a step.
When another process keeps one of two cores busy, the thread that shares that core gets a slice
of it every few milliseconds, and every op waits for that slice: with one busy-loop process on a
2-core AMD EPYC, two threads kept 0.28–0.35× of SmolLM2's idle speed, the adaptive count
0.55–0.84× (README, "A busy neighbour"). A thread count that leaves the busy cores to their
owners waits for nobody. So:

- Every `interval_s`, computing or idle (so that the count is right when work arrives), the engine
  reports a sample: wall time, the busy CPU time of all the CPUs this process may run on, and
  this process's own CPU time. The other processes' load is (Δbusy − Δown) / Δwall, in cores.
- The count is the CPUs minus that load, rounded with a margin (`busy_margin`: load up to 0.3 of
  a core is ignored), at least 1, at most `max_threads`.
- It drops at once (a busy neighbour costs far more than one thread fewer) and rises only after
  `rise_after` samples in a row that ask for more (a neighbour that pauses for a moment does
  not make the team flap).

A fixed count (`--threads N`) turns the policy off: `observe` then always says N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuSample:
    """CPU time counters at one moment (seconds)."""

    wall_s: float  # a monotonic clock
    busy_s: float  # time every CPU this process may use spent busy (user, nice, system, irq), summed
    own_s: float  # this process's CPU time (user + system), all its threads


@dataclass
class ThreadPolicy:
    """The engine's thread count: `max_threads` on an idle machine, fewer while others are busy."""

    cpus: int  # CPUs this process may run on
    fixed: int | None = None  # a count the user chose: never changed
    max_threads: int | None = None  # the most threads when adaptive (None: `cpus`)
    interval_s: float = 0.25  # the least wall time between two decisions
    busy_margin: float = 0.3  # other load (cores) below this much is ignored
    rise_after: int = 2  # samples in a row that want more threads before the count rises

    def __post_init__(self) -> None:
        if self.cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {self.cpus}")
        if self.fixed is not None and self.fixed < 1:
            raise ValueError(f"a fixed thread count must be >= 1, got {self.fixed}")
        self.max_threads = min(self.max_threads or self.cpus, self.cpus)
        self.threads = self.fixed or self.max_threads
        self.other_load = 0.0  # cores the other processes kept busy over the last interval
        self._last: CpuSample | None = None
        self._wanting_more = 0

    @property
    def adaptive(self) -> bool:
        return self.fixed is None

    def due(self, wall_s: float) -> bool:
        """Whether a sample taken now would be used (an interval has passed since the last)."""
        return self.adaptive and (self._last is None or wall_s - self._last.wall_s >= self.interval_s)

    def observe(self, sample: CpuSample) -> int:
        """Take a sample; the thread count to run the next steps with."""
        if not self.adaptive:
            return self.threads
        last, self._last = self._last, sample
        if last is None:
            return self.threads
        elapsed = sample.wall_s - last.wall_s
        if elapsed <= 0:
            return self.threads
        others = (sample.busy_s - last.busy_s) - (sample.own_s - last.own_s)
        self.other_load = max(0.0, others / elapsed)
        return self._decide(self.wanted(self.other_load))

    def wanted(self, other_load: float) -> int:
        """The thread count that leaves `other_load` cores to the other processes."""
        assert self.max_threads is not None
        taken = max(0, math.ceil(other_load - self.busy_margin))
        return max(1, min(self.max_threads, self.cpus - taken))

    def _decide(self, wanted: int) -> int:
        if wanted < self.threads:
            self.threads, self._wanting_more = wanted, 0
        elif wanted > self.threads:
            self._wanting_more += 1
            if self._wanting_more >= self.rise_after:
                self.threads, self._wanting_more = wanted, 0
        else:
            self._wanting_more = 0
        return self.threads


__all__ = ["CpuSample", "ThreadPolicy"]
