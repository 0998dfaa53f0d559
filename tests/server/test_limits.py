"""Backpressure and deadlines on a live server with small limits: requests beyond the queue get 429
with Retry-After in OpenAI's error shape (by count and by tokens), later ones succeed; a request
running past its deadline is an error (503 in OpenAI's shape, or a final SSE error event once the
stream has begun; never a 200 with a finish reason OpenAI does not define) and gives its KV back
uncached."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from polylane.server.config import Limits
from tests.server.conftest import (
    SMOL,
    LiveServer,
    assert_error,
    kv_of,
    sse_events,
    start_server,
    total_finished,
    wait_blocks_free,
    wait_until,
)

TIMEOUT_S = 1.0
LIMITS = Limits(max_waiting_requests=2, max_waiting_tokens=2000, request_timeout_s=TIMEOUT_S)
LONG = {"model": SMOL, "prompt": [1] * 10, "max_tokens": 990, "ignore_eos": True}  # reserves 1,000


@pytest.fixture(scope="module")
def live():
    server = start_server((SMOL,), limits=LIMITS, kv_tokens=1024)
    try:
        with server.client() as http:  # resident before any timing-sensitive test (the first
            # request may run past the 1 s deadline while the model loads: a 503, then 200s)
            wait_until(
                lambda: (
                    http.post(
                        "/v1/completions", json={"model": SMOL, "prompt": "Hi", "max_tokens": 1}
                    ).is_success
                ),
                timeout=60,
                what="the model to serve",
            )
        yield server
    finally:
        server.stop()


@pytest.fixture
def idle(live: LiveServer) -> LiveServer:
    wait_until(lambda: live.state.admission.requests == 0, timeout=15, what="admission to drain")
    wait_blocks_free(live.state)
    return live


def _burst(live: LiveServer, bodies: list[dict]) -> list[httpx.Response]:
    start = threading.Barrier(len(bodies))

    def send(body: dict) -> httpx.Response:
        with live.client(timeout=60) as http:
            start.wait()
            return http.post("/v1/completions", json=body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def _assert_429(response: httpx.Response) -> None:
    assert_error(response, 429, code="queue_full")
    assert response.json()["error"]["type"] == "rate_limit_error"
    retry = response.headers.get("retry-after")
    assert retry is not None and retry.isdigit() and int(retry) >= 1, response.headers


def test_requests_beyond_the_queue_get_429_with_retry_after(idle):
    refused_before = idle.state.admission.refused
    responses = _burst(idle, [LONG] * 6)
    ok = [r for r in responses if r.status_code != 429]  # admitted, then past the deadline
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) == 2, [r.status_code for r in responses]
    for response in refused:
        _assert_429(response)
    assert idle.state.admission.refused - refused_before == 4
    for response in ok:  # the admitted ones ran into the deadline
        assert_error(response, 503, code="request_timeout")
    wait_until(lambda: idle.state.admission.requests == 0, timeout=10, what="admission to drain")
    with idle.client() as http:
        later = [http.post("/v1/completions", json={**LONG, "max_tokens": 2}) for _ in range(3)]
    assert [r.status_code for r in later] == [200, 200, 200]


def test_the_token_bound_refuses_too(idle):
    with idle.client(timeout=60) as http:
        first = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": LONG})
        first.start()
        wait_until(lambda: idle.state.admission.requests == 1, timeout=5, what="the first request")
        over = http.post("/v1/completions", json={**LONG, "max_tokens": 991})  # 1,000 + 1,001 > 2,000
        _assert_429(over)
        # 1,000 + 12 fits, and ends within the 1 s deadline beside the first even on a slow CPU (a
        # 2-core AMD EPYC Zen 3 ran past it with 10 tokens)
        fits = http.post("/v1/completions", json={**LONG, "max_tokens": 2})
        assert fits.status_code == 200, fits.text
        first.join()


def test_a_request_larger_than_the_whole_queue_is_a_400_not_a_429(idle):
    with idle.client() as http:
        response = http.post("/v1/completions", json={**LONG, "max_tokens": 600, "n": 4})  # 4 x 610
    error = assert_error(response, 400, code="request_too_large")
    assert "2440" in error["message"] and "2000" in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_deadline_is_an_error_and_frees_its_blocks(idle, stream):
    state = idle.state
    before = total_finished(state, "deadline")
    prompt = "Write the longest story you can about a dragon who learns to cook soup. " * 4
    body = {"model": SMOL, "prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": stream}
    started = time.monotonic()
    with idle.client() as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200  # the stream had begun: the error is its last event
                events = list(sse_events(response.iter_lines()))
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "request_timeout", events[-2]
            assert "deadline" in events[-2]["error"]["message"]
            chunks = events[:-2]
            assert chunks and "".join(e["choices"][0]["text"] for e in chunks), "the tokens made are streamed"
            assert all(e["choices"][0]["finish_reason"] is None for e in chunks), chunks[-1]
        else:
            response = http.post("/v1/completions", json=body)
            error = assert_error(response, 503, code="request_timeout")
            assert "deadline" in error["message"] and response.headers.get("retry-after") == "1"
    elapsed = time.monotonic() - started
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5, elapsed
    wait_until(lambda: total_finished(state, "deadline") - before == 1, timeout=5, what="the deadline")
    wait_blocks_free(state)
    ids = idle.engine.prompt_ids(SMOL, prompt)
    assert len(ids) > 32
    assert kv_of(state, SMOL).tree.num_cached_tokens(ids) == 0, "KV of a request cut short entered the cache"
    assert state.admission.requests == 0
