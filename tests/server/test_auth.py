"""A server started with an API key: every route in the app's route table (and any other path)
refuses a request without the key or with a wrong one (401, OpenAI's error shape), `/health` stays
open, and the right key works, through raw HTTP and through the official client."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from starlette.routing import Route

from tests.server.conftest import API_KEY, SMOL, LiveServer, assert_error, start_server


@pytest.fixture(scope="module")
def live():
    server = start_server((SMOL,), api_key=API_KEY, kv_tokens=512)
    try:
        yield server
    finally:
        server.stop()


def _walk(routes: list, prefix: str = "") -> list[tuple[str, str]]:
    """(method, path) of every route, descending into included routers (FastAPI keeps them as
    objects with their own route lists in recent versions, flattened in older ones)."""
    calls = []
    for route in routes:
        if isinstance(route, Route):  # APIRoute and the docs routes
            for method in sorted(route.methods or {"GET"}):
                calls.append((method, prefix + route.path))
        elif hasattr(route, "original_router"):
            inner = prefix + getattr(getattr(route, "include_context", None), "prefix", "")
            calls.extend(_walk(route.original_router.routes, inner))
        elif hasattr(route, "routes"):  # a mount
            calls.extend(_walk(route.routes, prefix + getattr(route, "path", "")))
    return calls


def _route_table(live: LiveServer) -> list[tuple[str, str]]:
    """The app's routes, path parameters filled with a served model."""
    return [(method, re.sub(r"\{[^}]+\}", SMOL, path)) for method, path in _walk(live.app.routes)]


def test_the_route_table_is_walked(live):
    walked = set(_walk(live.app.routes))
    documented = {
        (method.upper(), path) for path, item in live.app.openapi()["paths"].items() for method in item
    }
    assert documented <= walked, f"routes the walk missed: {sorted(documented - walked)}"
    paths = {path for _, path in _route_table(live)}
    for expected in (
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        f"/admin/models/{SMOL}/evict",
        "/admin/budget",
        "/metrics",
        "/health",
        "/openapi.json",
    ):
        assert expected in paths, sorted(paths)


WRONG = [
    None,  # no Authorization header
    f"Bearer {API_KEY}x",
    f"Bearer {API_KEY[:-1]}",
    "Bearer",
    f"Basic {API_KEY}",
    API_KEY,  # the key without the scheme
    f"Bearer {API_KEY.upper()}",
    "Bearer " + "k" * 5000,
]


@pytest.mark.parametrize("authorization", WRONG, ids=lambda a: "none" if a is None else a[:24])
def test_every_route_but_health_refuses_a_missing_or_wrong_key(live, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    calls = [*_route_table(live), ("GET", "/no/such/route"), ("POST", "/admin/models/nope/load")]
    with live.client() as http:
        http.headers.pop("Authorization", None)
        for method, path in calls:
            body = {"model": SMOL, "prompt": "Hi", "max_tokens": 1} if method == "POST" else None
            response = http.request(method, path, json=body, headers=headers)
            if path.startswith("/health"):
                assert response.status_code == 200, response.text
                continue
            if method == "HEAD":  # no body to carry the error
                assert response.status_code == 401, (method, path)
                continue
            error = assert_error(response, 401, code="invalid_api_key")
            assert error["type"] == "authentication_error"
            assert API_KEY not in response.text and len(response.content) < 500
    assert live.engine.stats().models.get(SMOL) is None or live.engine.stats().models[SMOL].requests == 0


def test_the_right_key_works(live):
    with live.client() as http:
        for scheme in ("Bearer", "bearer"):
            response = http.post(
                "/v1/completions",
                json={"model": SMOL, "prompt": "Hi", "max_tokens": 2},
                headers={"Authorization": f"{scheme} {API_KEY}"},
            )
            assert response.status_code == 200, response.text
        assert http.get("/v1/models").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/admin/models").status_code == 200
    with live.openai() as client:
        assert [m.id for m in client.models.list()] == [SMOL]
        reply = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content
    wrong = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_metrics_public_opens_metrics_alone():
    """`--metrics-public`: a scraper reads /metrics without the key; every other route still asks."""
    server = start_server((SMOL,), api_key=API_KEY, kv_tokens=256, metrics_public=True)
    try:
        assert httpx.get(f"{server.base_url}/metrics", timeout=30).status_code == 200
        assert_error(httpx.get(f"{server.base_url}/v1/models", timeout=30), 401, code="invalid_api_key")
        assert_error(httpx.get(f"{server.base_url}/admin/models", timeout=30), 401, code="invalid_api_key")
    finally:
        server.stop()
