"""Busy-loop processes that keep cores busy while a bench phase runs (`--cpu-hog N`).

What this module owns: starting N processes that spin in a tight loop (a neighbour that never
sleeps, like a build or another server on a shared machine), making sure they are spinning before
the phase starts, and stopping them after it, whatever happens in between. The harness decides
when; this only starts and stops.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "import sys\nsys.stdout.write('spinning\\n'); sys.stdout.flush()\nwhile True:\n    pass\n"


@contextmanager
def busy_loops(count: int, settle_s: float = 0.5) -> Iterator[list[int]]:
    """`count` busy-loop processes running for the body of the `with`; yields their pids."""
    processes: list[subprocess.Popen[str]] = []
    try:
        for _ in range(count):
            processes.append(
                subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
            )
        for process in processes:
            assert process.stdout is not None
            process.stdout.readline()  # started and spinning
        if processes:
            time.sleep(settle_s)  # let the scheduler settle the spinners before measuring
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
            if process.stdout is not None:
                process.stdout.close()


__all__ = ["busy_loops"]
