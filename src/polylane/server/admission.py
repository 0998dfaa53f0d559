"""Backpressure: a bounded count of unfinished requests and of the tokens they may still need.

What this module owns: the server's admission counter. A request reserves one slot and its prompt
plus max_tokens; when either bound would be passed it is refused (the route answers 429 with a
Retry-After), and it releases both when it ends, however it ends. Thread-safe; no I/O.
"""

from __future__ import annotations

import threading


class QueueFullError(Exception):
    pass


class Admission:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = 0
        self.tokens = 0
        self.refused = 0
        self._lock = threading.Lock()

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
