"""Stop strings over streamed text: never emit a stop string, even when it spans several tokens.

Text arrives in pieces (one per token). A piece is released only up to the point where no stop
string could still begin: the last `longest stop - 1` characters are held back until more text
shows they are not the start of a stop string. When a stop string appears, everything before it
is released and the rest (the stop string and anything after it) never is. When several stop
strings occur in the text at hand, the one that completes first wins (a stream cut token by token
would have stopped there), and of those completing at the same character the longest is cut, so the
output never depends on how the text was split into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._hold = max((len(stop) for stop in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add a piece of text; return what can be released now (empty once stopped)."""
        if self.stopped:
            return ""
        self._pending += text
        cut = self._first_stop()
        if cut >= 0:
            self.stopped = True
            released, self._pending = self._pending[:cut], ""
            return released
        keep = min(self._hold, len(self._pending))
        released = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(released) :]
        return released

    def _first_stop(self) -> int:
        """Where the stop string that completes first in the pending text begins; -1 if none."""
        ends = [i + len(stop) for stop in self.stops if (i := self._pending.find(stop)) >= 0]
        if not ends:
            return -1
        end = min(ends)
        return end - max(len(stop) for stop in self.stops if self._pending.endswith(stop, 0, end))

    def flush(self) -> str:
        """At the end of the stream: release what was held back (nothing if a stop string hit)."""
        released, self._pending = ("" if self.stopped else self._pending), ""
        return released
