"""`polylane serve` stopped by SIGTERM (a real process): a short stream in flight finishes normally,
a long one is ended after --drain-timeout with a final SSE error event (never cut without a last
word), and the process exits with status 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.conftest import fetch_or_skip
from tests.server.conftest import SMOL, serve_process, sse_events

DRAIN_S = 2.0


def _stream(base: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = True
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        events.append(response.status_code)
        for event in sse_events(response.iter_lines()):
            events.append(event)
            started.set()


def test_sigterm_drains_for_the_timeout_then_ends_the_rest_and_exits_0(tmp_path):
    fetch_or_skip(SMOL)
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        server, base = serve_process([SMOL, "--drain-timeout", str(DRAIN_S)], sink, tmp_path)
        try:
            long_events: list = []
            short_events: list = []
            long_started, short_started = threading.Event(), threading.Event()
            threads = [
                threading.Thread(target=_stream, args=(base, 3000, long_events, long_started)),
                threading.Thread(target=_stream, args=(base, 24, short_events, short_started)),
            ]
            for thread in threads:
                thread.start()
            assert long_started.wait(60) and short_started.wait(60), log.read_text()[-3000:]
            stopped_at = time.monotonic()
            server.send_signal(signal.SIGTERM)
            for thread in threads:
                thread.join(timeout=60)
            ended_after = time.monotonic() - stopped_at
            assert server.wait(timeout=60) == 0, log.read_text()[-3000:]
        finally:
            if server.poll() is None:
                server.kill()
    text = log.read_text()
    assert short_events[0] == 200 and short_events[-1] == "[DONE]", short_events[-3:]
    assert short_events[-2]["choices"][0]["finish_reason"] == "length", short_events[-2]
    assert long_events[0] == 200 and long_events[-1] == "[DONE]", long_events[-3:]
    assert long_events[-2]["error"]["code"] == "server_shutting_down", long_events[-2]
    assert DRAIN_S <= ended_after < DRAIN_S + 20, ended_after
    assert "drain timeout" in text and "ended 1 requests" in text, text[-2000:]
