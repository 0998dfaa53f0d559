"""A live polylane server on 127.0.0.1 for the server tests: start, clients, checks, stop.

`start_server(...)` builds the engine from a `ServerConfig` (real models, fp32 unless asked, small KV), runs
uvicorn in a daemon thread on a free port and waits for `/health`; `LiveServer.stop()` asks uvicorn
to exit, joins the thread and checks the app's lifespan closed the engine. The session fixture
`shared_server` serves the three real models with default limits (the OpenAI client, bad-input,
fuzz and concurrency modules share it: loading models is the slow part); modules that need other
limits, an API key or a budget to play with start their own.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from polylane.server.app import build_state, create_app
from polylane.server.config import Limits, ModelDecl, ServerConfig
from polylane.server.state import ServerState
from tests.conftest import fetch_or_skip

SMOL, GEMMA, QWEN = "smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"
ALL_MODELS = (SMOL, GEMMA, QWEN)
KV_TOKENS = 1024
BUDGET = 8 * 2**30
API_KEY = "sk-test-polylane"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    state: ServerState
    app: Any
    port: int
    server: uvicorn.Server
    thread: threading.Thread
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> Any:
        return self.state.engine

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.headers())

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "uvicorn did not stop"
        if self.engine.alive:  # the lifespan should have closed it; never leak an engine thread
            self.engine.close()
            pytest.fail("the app's lifespan did not close the engine")


def start_server(
    models: tuple[str, ...] = ALL_MODELS,
    *,
    limits: Limits | None = None,
    api_key: str | None = None,
    budget_bytes: int = BUDGET,
    kv_tokens: int = KV_TOKENS,
    pinned: tuple[str, ...] = (),
    dtype: str = "fp32",
    more: tuple[ModelDecl, ...] = (),
    metrics_public: bool = False,
    allowed_origins: tuple[str, ...] = (),
    eviction: str = "lru",
) -> LiveServer:
    """`more`: models declared as they are (a file of the test's own) after `models`."""
    for name in models:
        fetch_or_skip(name)
    config = ServerConfig(
        models=tuple(
            ModelDecl(name, name, dtype=dtype, pinned=name in pinned, kv_tokens=kv_tokens) for name in models
        )
        + more,
        budget_bytes=budget_bytes,
        api_key=api_key,
        limits=limits or Limits(),
        metrics_public=metrics_public,
        allowed_origins=allowed_origins,
        eviction=eviction,
    )
    state = build_state(config, quiet=True)
    app = create_app(state)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    live = LiveServer(state, app, port, server, thread, api_key)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{live.base_url}/health", timeout=2).status_code == 200:
                return live
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            thread.join(timeout=30)
            state.engine.close()
            pytest.fail("the server did not answer /health within 60 s")
        time.sleep(0.05)


def serve_process(args: list[str], log, cwd) -> tuple[subprocess.Popen, str]:
    """`polylane serve ARGS --port P` as a real process writing its log to `log`; (the process, its
    base URL) once `/health` answers 200 (the caller stops it)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "polylane.cli", "serve", *args, "--port", str(port)]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    deadline = time.monotonic() + 180
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"polylane serve did not become ready (status {server.poll()})")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return server, base
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.fixture(scope="session")
def shared_server() -> Iterator[LiveServer]:
    live = start_server(ALL_MODELS)
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def shared_client(shared_server: LiveServer) -> Iterator[Any]:
    """The official `openai` client on the shared server."""
    with shared_server.openai(timeout=120) as client:
        yield client


# ---------------------------------------------------------------------- checks


def assert_error(
    response: httpx.Response, status: int, *, param: str | None = ..., code: str | None = ...
) -> dict:
    """The response is `status` with OpenAI's error shape; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert isinstance(error["code"], str) and error["code"], error  # never null
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


def kv_of(state: ServerState, name: str) -> Any:
    handle = state.engine.manager._pool.handle(name)  # the resident model, for block accounting
    return None if handle is None else handle.kv


def blocks_held(state: ServerState) -> dict[str, tuple[int, int]]:
    """Per resident model: (prefix leases, blocks held by requests); all zeros when idle."""
    held = {}
    for name in state.engine.models:
        kv = kv_of(state, name)
        if kv is None:
            continue
        held[name] = (kv.tree.num_locks, kv.pool.num_blocks - kv.pool.num_free - kv.tree.num_cached_blocks)
    return held


def wait_blocks_free(state: ServerState, timeout: float = 20.0) -> None:
    """Poll until every resident model's KV blocks are free or cached (no lease, no request)."""
    deadline = time.monotonic() + timeout
    while True:
        held = blocks_held(state)
        if all(h == (0, 0) for h in held.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"KV still held (model: (prefix leases, request blocks)): {held}")
        time.sleep(0.05)


def finished_counts(state: ServerState) -> dict[str, dict[str, int]]:
    return {name: dict(model.finished) for name, model in state.engine.stats().models.items()}


def total_finished(state: ServerState, reason: str | None = None) -> int:
    return sum(
        count
        for reasons in finished_counts(state).values()
        for why, count in reasons.items()
        if reason is None or why == reason
    )


def total_submitted(state: ServerState) -> int:
    return sum(model.requests for model in state.engine.stats().models.values())


def wait_until(predicate: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """Parsed `data:` payloads of an SSE stream; the string "[DONE]" for the terminator."""
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: ") :]
        yield "[DONE]" if payload == "[DONE]" else json.loads(payload)
