"""Replaying a phase against a client: arrival times, the concurrency cap, one clock. No torch.

What this module owns: sending each request of a `Phase` at its arrival time (seconds after the
phase starts), holding it back while `concurrency` requests are in flight (first come, first
served), and collecting the `RequestTimeline` each send returns. A client (in-process engine, HTTP
server) only knows how to send one request and time its tokens on the clock it is given; it never
raises for a failed request but returns a timeline whose finish_reason is "error".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from polylane.bench.metrics import RequestTimeline
from polylane.bench.workloads import BenchRequest, Phase

Clock = Callable[[], float]  # seconds since the phase started


class Client(Protocol):
    def send(self, request: BenchRequest, now: Clock) -> Awaitable[RequestTimeline]:
        """Send one request, stream its output, return its timeline (times from `now()`)."""
        ...


def error_timeline(request: BenchRequest, sent: float, error: BaseException | str) -> RequestTimeline:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return RequestTimeline(
        request.request_id, request.model, request.category, sent, None, None, 0, 0, 0, "error", message
    )


async def replay(
    phase: Phase, client: Client, on_done: Callable[[RequestTimeline], None] | None = None
) -> list[RequestTimeline]:
    """Run every request of `phase` through `client`; timelines in the phase's request order."""
    started = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - started

    cap = asyncio.Semaphore(phase.concurrency) if phase.concurrency else None

    async def one(request: BenchRequest) -> RequestTimeline:
        delay = request.arrival_s - now()
        if delay > 0:
            await asyncio.sleep(delay)
        if cap is None:
            timeline = await _send(client, request, now)
        else:
            async with cap:
                timeline = await _send(client, request, now)
        if on_done is not None:
            on_done(timeline)
        return timeline

    return list(await asyncio.gather(*(one(r) for r in phase.requests)))


async def _send(client: Client, request: BenchRequest, now: Clock) -> RequestTimeline:
    sent = now()
    try:
        return await client.send(request, now)
    except Exception as error:  # a client bug or a dropped connection fails only this request
        return error_timeline(request, sent, error)
