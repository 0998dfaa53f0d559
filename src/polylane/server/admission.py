"""Backpressure: a bounded count of unfinished requests and of the tokens they may still need.

What this module owns: the server's admission counter. A request reserves one slot and its prompt
plus max_tokens; when either bound would be passed it is refused (the route answers 429 with a
Retry-After), and it releases both when it ends, however it ends. It also measures how fast
requests drain (ends per second over the last DRAIN_WINDOW_S), from which a refused or timed-out
request is told when to retry. Thread-safe; no I/O.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

DRAIN_WINDOW_S = 60.0
MAX_RETRY_AFTER_S = 600


class QueueFullError(Exception):
    pass


class Admission:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = 0
        self.tokens = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._ends: deque[float] = deque()  # when requests ended, the last DRAIN_WINDOW_S

    def reserve(self, tokens: int) -> None:
        with self._lock:
            if self.requests + 1 > self.max_requests or self.tokens + tokens > self.max_tokens:
                self.refused += 1
                raise QueueFullError(
                    f"the server is full ({self.requests} requests, {self.tokens} tokens queued; limits "
                    f"{self.max_requests} and {self.max_tokens}); retry shortly"
                )
            self.requests += 1
            self.tokens += tokens

    def release(self, tokens: int) -> None:
        with self._lock:
            self.requests -= 1
            self.tokens -= tokens
            self._ends.append(time.monotonic())
            self._forget_old(time.monotonic())

    def retry_after_s(self, fallback_s: float) -> int:
        """Seconds until the requests queued now have drained at the measured rate (ends over the
        last DRAIN_WINDOW_S), from 1 to MAX_RETRY_AFTER_S; `fallback_s` when nothing ended lately."""
        with self._lock:
            now = time.monotonic()
            self._forget_old(now)
            if not self._ends:
                seconds = fallback_s
            else:
                window = min(DRAIN_WINDOW_S, max(now - self._ends[0], 1.0))
                seconds = self.requests / (len(self._ends) / window)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))

    def _forget_old(self, now: float) -> None:
        while self._ends and now - self._ends[0] > DRAIN_WINDOW_S:
            self._ends.popleft()
