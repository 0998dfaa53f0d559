"""Bounded waits on a live server: a request that has not begun within limits.max_queue_s (here its
model is still loading) gets 503 "queue_timeout" with a Retry-After, streamed or not, and is
counted; a request's own `timeout` ends it as an error when it is shorter than the server's
deadline; once the model is resident, requests start at once and succeed."""

from __future__ import annotations

import pytest

from polylane.runtime.residency.manager import ModelInfo
from polylane.server.config import Limits
from tests.server.conftest import SMOL, assert_error, start_server, total_finished, wait_until

QUEUE_S = 0.3  # far below a model load (seconds), far above an idle engine's time to a first step


@pytest.fixture(scope="module")
def live():
    server = start_server((SMOL,), limits=Limits(max_queue_s=QUEUE_S), kv_tokens=2048)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_waits_past_the_queue_bound_is_a_503_with_retry_after(live, stream):
    def info() -> ModelInfo:
        return next(i for i in live.engine.manager.snapshot() if i.name == SMOL)

    # an earlier case's load ends, and the engine gives its lease back (its request is gone)
    wait_until(lambda: info().state != "loading" and info().in_flight == 0, timeout=60, what="the model idle")
    if info().state == "resident":
        live.engine.manager.evict(SMOL)  # cold: the request waits for a load
    before = total_finished(live.state, "queue_timeout")
    with live.client() as http:
        body = {"model": SMOL, "prompt": "Hello", "max_tokens": 4, "stream": stream}
        response = http.post("/v1/completions", json=body)  # the model loads for seconds: no step
    error = assert_error(response, 503, code="queue_timeout")
    assert "max_queue_s" in error["message"], error
    assert int(response.headers["retry-after"]) >= 1, dict(response.headers)
    assert total_finished(live.state, "queue_timeout") - before == 1


def test_a_resident_model_starts_requests_within_the_bound(live):
    with live.client() as http:
        assert http.post(f"/admin/models/{SMOL}/load").status_code == 200
        for _ in range(3):
            response = http.post("/v1/completions", json={"model": SMOL, "prompt": "Hello", "max_tokens": 4})
            assert response.status_code == 200, response.text


def test_a_requests_own_timeout_ends_it_as_an_error(live):
    body = {"model": SMOL, "prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True}
    body["timeout"] = 0.5
    with live.client() as http:
        assert http.post(f"/admin/models/{SMOL}/load").status_code == 200
        response = http.post("/v1/completions", json=body)
        error = assert_error(response, 503, code="request_timeout")
        assert "0.5 s" in error["message"] and "the request's timeout" in error["message"], error
        refused = http.post("/v1/completions", json={**body, "timeout": "1"})
        assert_error(refused, 400, param="timeout")
