"""Background work on a thread that exits when it runs out of work.

What this module owns: `TransientWorker`, which runs submitted calls one at a time, in order, on
a thread it starts on demand and that ends as soon as its queue is empty.

Why not a `ThreadPoolExecutor`: its threads live as long as the executor. A thread that has run
torch ops owns an OpenMP thread team for as long as it lives, and libgomp, once a process holds
more OpenMP threads than CPUs, stops spinning between parallel regions and puts its workers to
sleep instead, so every op of the thread that does run pays a futex wake (`bench/thread_teams.py`:
a one-row matmul 240 µs alone, 345 µs while one such idle thread lives). Model loads run torch ops,
so the engine keeps its loader thread only while it loads.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class TransientWorker:
    """Runs calls in submission order on one short-lived thread at a time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, call: Callable[..., Any], *args: Any) -> None:
        """Queue `call(*args)`; starts the worker thread if none is running."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            self._queue.append((call, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name=self.name, daemon=True)
                self._thread.start()

    def shutdown(self) -> None:
        """Refuse new calls and wait for the queued ones to finish."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join()

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None  # the next submit starts a fresh thread
                    return
                call, args = self._queue.popleft()
            try:
                call(*args)
            except Exception:  # the call reports its own errors; never kill the queue
                log.exception("%s: background call failed", self.name)


def run_in_transient_thread(call: Callable[..., Any], *args: Any, name: str = "polylane-load") -> Any:
    """Run `call(*args)` on a fresh thread that ends with it; return its result or raise its error.

    Every model load goes through it (`ResidencyManager._load`), whichever long-lived thread asks:
    the load's OpenMP team goes away with the thread instead of slowing the engine from then on.
    """
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, call(*args)))
        except BaseException as error:  # re-raised in the caller's thread
            outcome.append((False, error))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value
