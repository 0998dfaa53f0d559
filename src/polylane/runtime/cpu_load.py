"""Sampling how busy this machine's CPUs are, and applying a thread count to the compute threads.

What this module owns: reading the CPU time counters the thread policy (`policy/scheduling/threads.py`)
decides from — /proc/stat's busy time of the CPUs this process may run on and this process's own
CPU time — and `ComputeThreads`, which the engine thread asks once per step and which sets torch's
thread count (the native stack reads the same count per call). Where /proc/stat cannot be read
(not Linux), the policy keeps its starting count.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from polylane.policy.scheduling.threads import CpuSample, ThreadPolicy

log = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
# torch's own count before the engine changes it: its physical cores, or OMP_NUM_THREADS
TORCH_DEFAULT_THREADS = torch.get_num_threads()
# /proc/stat's per-CPU fields: user nice system idle iowait irq softirq steal guest guest_nice;
# busy = user + nice + system + irq + softirq (guest time is inside user already)
BUSY_FIELDS = (0, 1, 2, 5, 6)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def busy_seconds(cpus: set[int], text: str | None = None) -> float | None:
    """Busy CPU time of `cpus` summed, from /proc/stat (or `text` in its format); None if unreadable."""
    if text is None:
        try:
            text = PROC_STAT.read_text()
        except OSError:
            return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    found = False
    for line in text.splitlines():
        name, _, values = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = values.split()
        total += sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
        found = True
    return total / ticks if found else None


def sample(cpus: set[int]) -> CpuSample | None:
    busy = busy_seconds(cpus)
    if busy is None:
        return None
    return CpuSample(wall_s=time.monotonic(), busy_s=busy, own_s=time.process_time())


class ComputeThreads:
    """The engine's compute thread count: fixed, or following `ThreadPolicy` as other load comes
    and goes. `step()` is called by the engine thread after each step and on each idle wake-up; it
    costs a clock read except when a decision is due (four times a second: one read of
    /proc/stat, ~30 µs)."""

    def __init__(self, threads: int = 0) -> None:
        """threads: 0 adapts, from torch's default count (its physical cores, or OMP_NUM_THREADS)
        down to 1; N > 0 runs N threads whatever the load."""
        self.cpus = usable_cpus()
        if threads < 0:
            raise ValueError(f"threads must be >= 0 (0: adapt to the machine's load), got {threads}")
        ceiling = min(TORCH_DEFAULT_THREADS, len(self.cpus)) if threads == 0 else threads
        self.policy = ThreadPolicy(cpus=len(self.cpus), fixed=threads or None, max_threads=ceiling)
        self._before = torch.get_num_threads()
        self._apply(self.policy.threads)

    @property
    def threads(self) -> int:
        return self.policy.threads

    def step(self) -> None:
        if not self.policy.due(time.monotonic()):
            return
        now = sample(self.cpus)
        if now is not None:
            threads = self.policy.observe(now)
            if threads != torch.get_num_threads():
                log.info(
                    "compute threads %d -> %d (other processes keep %.1f of %d CPUs busy)",
                    torch.get_num_threads(), threads, self.policy.other_load, len(self.cpus),
                )  # fmt: skip
                self._apply(threads)

    def restore(self) -> None:
        """Put torch's thread count back as it was before this engine (the engine closes)."""
        self._apply(self._before)

    @staticmethod
    def _apply(threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


__all__ = ["ComputeThreads", "busy_seconds", "sample", "usable_cpus"]
