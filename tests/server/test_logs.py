"""The server's log: one access line per request (method, route, status, model, tokens as the
response's usage reports them, TTFT, total ms), probes and scrapes at debug; `--log-format json`
writes every line, uvicorn's and the load's included, as one JSON object, and no progress bar."""

from __future__ import annotations

import json
import logging
import signal

import httpx
import pytest

from tests.conftest import fetch_or_skip
from tests.server.conftest import SMOL, serve_process, start_server


@pytest.fixture(scope="module")
def live():
    server = start_server((SMOL,), kv_tokens=256)
    try:
        yield server
    finally:
        server.stop()


def test_each_request_gets_one_access_line_with_its_usage(live, caplog):
    caplog.set_level(logging.DEBUG, logger="polylane.access")
    with live.client() as http:
        body = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
        usage = http.post("/v1/completions", json=body).json()["usage"]
        streamed = {**body, "stream": True}
        assert http.post("/v1/completions", json=streamed).status_code == 200
        assert http.get("/no/such/route").status_code == 404
        assert http.get("/health").status_code == 200
    records = [(r.levelno, r.fields) for r in caplog.records if r.name == "polylane.access"]
    assert [fields["route"] for _, fields in records] == [
        "/v1/completions",
        "/v1/completions",
        "unmatched",
        "/health",
    ]
    (level, plain), (_, stream), (missing_level, missing), (health_level, _) = records
    assert level == logging.INFO and plain["status"] == 200 and plain["model"] == SMOL
    assert (plain["prompt_tokens"], plain["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert plain["ttft_ms"] > 0 and plain["total_ms"] >= plain["ttft_ms"]
    assert stream["completion_tokens"] == 3, "the stream's line is written after its last event"
    assert missing_level == logging.INFO and missing["status"] == 404 and "model" not in missing
    assert health_level == logging.DEBUG, "a probe that succeeds is logged at debug"


def test_json_logs_are_one_object_per_line_from_start_to_stop(tmp_path):
    fetch_or_skip(SMOL)
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        server, base = serve_process([SMOL, "--log-format", "json"], sink, tmp_path)
        try:
            body = {"model": SMOL, "prompt": "Hi", "max_tokens": 2}
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 200
        finally:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0
    entries = [json.loads(line) for line in log.read_text().splitlines()]  # every line is JSON
    messages = [e["message"] for e in entries]
    assert any(m.startswith(f"loaded {SMOL} ") for m in messages), messages
    assert any(m.startswith("serving ") for m in messages) and "stopped" in messages, messages
    access = [e for e in entries if e["logger"] == "polylane.access" and e.get("route") == "/v1/completions"]
    assert len(access) == 1 and access[0]["completion_tokens"] == 2 and access[0]["status"] == 200, access
    assert all(e["level"] in ("debug", "info", "warning", "error") for e in entries)
