"""The Ray app's parts that need no cluster: the in-process ASGI call a replica runs each request
through (whole responses, SSE, a caller that goes away), the ingress's model lookup, and the
aggregation of replica reports into `/v1/models` and `/metrics`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip(
    "ray.serve", reason="Ray Serve is not installed: pip install 'polylane[ray]' to run tests/ray"
)

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from polylane.server.config import ModelDecl, ServerConfig
from polylane.server.ray_app import PolylaneIngress, aggregate_models, merge_metrics
from polylane.server.ray_replica import call_asgi


def _app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        return {"body": (await request.json()), "query": request.url.query}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> Any:
            try:
                for index in range(1000):
                    yield f"data: {index}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("stream closed")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def _request(method: str, path: str, body: bytes = b"", query: str = "") -> dict[str, Any]:
    return {"method": method, "path": path, "query_string": query, "headers": [], "body": body}


def test_call_asgi_whole_response_arrives_in_one_part_with_headers() -> None:
    async def run() -> list[dict[str, Any]]:
        request = _request("POST", "/echo", json.dumps({"a": 1}).encode(), "x=1")
        request["headers"] = [("content-type", "application/json")]
        return [part async for part in call_asgi(_app([]), request, [("x-polylane-replica", "r1")])]

    parts = asyncio.run(run())
    assert len(parts) == 1
    assert parts[0]["status"] == 200 and parts[0]["more"] is False
    assert ("x-polylane-replica", "r1") in parts[0]["headers"]
    assert json.loads(parts[0]["body"]) == {"body": {"a": 1}, "query": "x=1"}


def test_call_asgi_streams_and_a_caller_that_leaves_closes_the_stream() -> None:
    events: list[str] = []

    async def run() -> list[dict[str, Any]]:
        parts = []
        generator = call_asgi(_app(events), _request("GET", "/stream"))
        async for part in generator:
            parts.append(part)
            if len(parts) == 3:
                break
        await generator.aclose()  # what Ray does when the ingress cancels the call
        for _ in range(100):
            if events:
                break
            await asyncio.sleep(0.01)
        return parts

    parts = asyncio.run(run())
    assert parts[0]["status"] == 200 and parts[0]["more"] is True
    assert [p["body"] for p in parts] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert events == ["stream closed"], "the app did not learn its client left"


def test_call_asgi_route_missing_is_the_apps_own_404() -> None:
    async def run() -> list[dict[str, Any]]:
        return [part async for part in call_asgi(_app([]), _request("GET", "/nothing"))]

    [part] = asyncio.run(run())
    assert part["status"] == 404


def test_ingress_model_id_resolves_aliases_and_ignores_the_rest() -> None:
    config = ServerConfig(
        models=(ModelDecl("smol", "smollm2-135m-instruct", aliases=("default",)), ModelDecl("gemma", "g")),
        budget_bytes=1,
    )
    ingress = PolylaneIngress(None, config, "app")  # type: ignore[arg-type]
    assert ingress.model_id(b'{"model": "default"}') == "smol"
    assert ingress.model_id(b'{"model": "gemma"}') == "gemma"
    for body in (b'{"model": "other"}', b'{"model": 3}', b"[1]", b"not json", b"\xff"):
        assert ingress.model_id(body) == "", body


HEADER = "# HELP polylane_x x\n# TYPE polylane_x gauge\n"


def test_aggregate_models_and_merge_metrics() -> None:
    def entry(name: str, state: str, size: int, in_flight: int) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "state": state,
            "bytes": size,
            "in_flight": in_flight,
            "pinned": False,
        }

    reports = [
        {
            "replica": "b",
            "models": [entry("smol", "resident", 500, 2), entry("gemma", "cold", 90, 0)],
            "metrics": HEADER + 'polylane_x{model="smol"} 1.0\npolylane_y 2.0\n',
        },
        {
            "replica": "a",
            "models": [entry("smol", "cold", 100, 0), entry("gemma", "loading", 80, 1)],
            "metrics": HEADER + 'polylane_x{model="smol"} 0.0\n',
        },
    ]
    models = aggregate_models(reports, ["smol", "gemma"].index)
    assert [m["id"] for m in models] == ["smol", "gemma"]
    smol, gemma = models
    assert (smol["state"], smol["bytes"], smol["in_flight"]) == ("resident", 500, 2)
    assert (gemma["state"], gemma["bytes"], gemma["in_flight"]) == ("loading", 80, 1)
    assert [r["replica"] for r in smol["replicas"]] == ["a", "b"]
    text = merge_metrics(reports)
    assert text.count("# TYPE polylane_x gauge") == 1
    assert 'polylane_x{replica="a",model="smol"} 0.0' in text
    assert 'polylane_x{replica="b",model="smol"} 1.0' in text
    assert 'polylane_y{replica="b"} 2.0' in text


@pytest.mark.parametrize("origins", [(), ("http://localhost:3000",)])
def test_the_ingress_answers_cors_only_for_the_origins_allowed(origins) -> None:
    from fastapi.testclient import TestClient

    from polylane.server.ray_app import create_ingress_app

    config = ServerConfig(
        models=(ModelDecl("smol", "smollm2-135m-instruct"),), budget_bytes=1, allowed_origins=origins
    )
    app = create_ingress_app(PolylaneIngress(None, config, "app"))  # type: ignore[arg-type]
    headers = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    response = TestClient(app).options("/v1/chat/completions", headers=headers)
    allowed = response.headers.get("access-control-allow-origin")
    assert allowed == ("http://localhost:3000" if origins else None)
