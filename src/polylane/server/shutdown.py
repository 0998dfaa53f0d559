"""Stopping `polylane serve`: a bounded drain, then an exit with status 0.

What this module owns: the uvicorn server `serve()` runs. On SIGTERM (or Ctrl-C) it stops accepting
connections at once and lets the requests in flight finish for the drain timeout
(`--drain-timeout`, 30 s by default); the ones still running then end with reason "shutdown" (a
final SSE error event on a stream that has begun, a 503 otherwise), so an orchestrator's grace
period never cuts a stream without a last word. The process then exits with status 0 (uvicorn
re-raises the signal it caught; the handler installed here turns SIGTERM into a clean exit).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

import uvicorn

from polylane.server.state import ServerState

log = logging.getLogger(__name__)
BACKSTOP_S = 15.0  # after the drain, how long uvicorn waits for the ended requests' connections


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = int(drain_timeout_s + BACKSTOP_S)
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s

    async def shutdown(self, sockets: Any = None) -> None:
        self.state.draining = True
        running = [h for h in self.state.open_handles if not h.done]
        if running:
            _say(f"stopping: {len(running)} requests running, {self.drain_timeout_s:g} s to finish")
        timer = asyncio.get_running_loop().call_later(self.drain_timeout_s, self._end_the_rest)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
        _say("stopped")

    def _end_the_rest(self) -> None:
        running = [h for h in self.state.open_handles if not h.done]
        for handle in running:
            handle.abort("shutdown")
        if running:
            _say(f"drain timeout ({self.drain_timeout_s:g} s): ended {len(running)} requests")


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM raises SystemExit(0) (installed before uvicorn captures signals, and restored and
    re-raised by it after its graceful shutdown)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def _say(message: str) -> None:
    log.info(message)
