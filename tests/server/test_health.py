"""`/health` on a live server: 200 while the engine runs; once the engine loop has died, 503 in
OpenAI's error shape, and completions are refused with 503 rather than hanging."""

from __future__ import annotations

import pytest

from tests.server.conftest import SMOL, LiveServer, assert_error, start_server, wait_until


@pytest.fixture
def live():
    server = start_server((SMOL,), kv_tokens=256)
    try:
        yield server
    finally:
        server.stop()


def test_health_is_503_once_the_engine_is_dead(live: LiveServer):
    with live.client(timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok", "models": 1}

        def boom():
            raise RuntimeError("injected scheduler failure")

        live.engine.scheduler.schedule = boom  # the loop's next step fails, as a bug would
        live.engine._wake.set()
        wait_until(lambda: not live.engine.alive, timeout=10, what="the engine loop to stop")

        error = assert_error(http.get("/health"), 503, code="engine_dead")
        assert "injected scheduler failure" in error["message"]
        body = {"model": SMOL, "prompt": "Hi", "max_tokens": 2}
        assert_error(http.post("/v1/completions", json=body), 503, code="engine_dead")
        assert_error(http.post("/v1/completions", json={**body, "stream": True}), 503, code="engine_dead")
        assert http.get("/v1/models").status_code == 200, "listing does not need the loop"
        assert live.state.admission.requests == 0, "a refused request kept its reservation"


def test_ready_and_live_are_told_apart(live: LiveServer):
    """Readiness (`/health`, `/health/ready`) is 503 while the first model loads and while shutting
    down; liveness (`/health/live`) stays 200 through both, as Kubernetes probes expect."""
    with live.client(timeout=30) as http:
        for path in ("/health", "/health/ready", "/health/live"):
            assert http.get(path).status_code == 200, path
        for flag, reason in (("ready", "loading the first model"), ("draining", "shutting down")):
            setattr(live.state, flag, flag == "draining")
            try:
                for path in ("/health", "/health/ready"):
                    error = assert_error(http.get(path), 503, code="not_ready")
                    assert reason in error["message"], error
                assert http.get("/health/live").json() == {"status": "live"}
            finally:
                setattr(live.state, flag, flag != "draining")
        assert http.get("/health").status_code == 200
