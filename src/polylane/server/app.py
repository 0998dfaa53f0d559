"""Wiring: the FastAPI app over one engine, its guards, and `serve()` behind `polylane serve`.

What this module owns: building the app (routes, error handlers), the two guards every request
passes first (the API key, compared in constant time, on every route but the health probes, and
`/metrics` with `--metrics-public`; the body size limit, 413 before the body is parsed, whether or
not the client sent a Content-Length),
the probes and `/metrics`, and starting the server: the port is bound before anything loads (a port
in use fails at once), the first model loads while the server already answers (`/health` 503
"loading" meanwhile), and a first model that cannot load stops the server with its reason.

Probes, as Kubernetes expects them: `/health/live` is 200 while the engine runs (503 once it died:
restart the process); `/health/ready` and `/health` are 200 when requests can be served now (503
while the first model loads, after the engine died, and while shutting down).
"""

from __future__ import annotations

import errno
import hmac
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from polylane.engine import Engine, EngineConfig
from polylane.policy.scheduling.scheduler import SchedulerConfig
from polylane.server import errors, logs, openapi, routes_admin, routes_openai
from polylane.server.config import ServerConfig
from polylane.server.errors import error_response
from polylane.server.logs import AccessLog
from polylane.server.shutdown import DrainingServer, exit_cleanly_on_sigterm
from polylane.server.state import ServerState

log = logging.getLogger(__name__)
OPEN_ROUTES = ("/health", "/health/live", "/health/ready")


class GuardMiddleware:
    """API key and body size, checked before any route runs (pure ASGI, so streaming is untouched)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, open_routes: tuple[str, ...]
    ) -> None:
        self.app, self.api_key = app, api_key
        self.max_body_bytes, self.open_routes = max_body_bytes, open_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in self.open_routes:
            supplied = headers.get("authorization", "")
            token = supplied[7:] if supplied[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                response = error_response(
                    401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key"
                )
                await response(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._too_large(scope, receive, send)
            return
        received = 0
        too_large = started = False

        async def counting_receive() -> Message:
            # Past the limit the app is told the client left (so nothing is parsed or run), and its
            # answer to that is dropped: the 413 goes out instead. Raising here would not do: the
            # framework turns any error while reading the body into a 400 of its own.
            nonlocal received, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if too_large and not started:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, f"request body over the limit of {self.max_body_bytes} bytes", code="body_too_large"
        )
        await response(scope, receive, send)


def add_guard(app: FastAPI, api_key: str | None, max_body_bytes: int, metrics_public: bool) -> None:
    """GuardMiddleware on `app`: the probes open, `/metrics` too when `metrics_public`."""
    open_routes = (*OPEN_ROUTES, "/metrics") if metrics_public else OPEN_ROUTES
    app.add_middleware(
        GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, open_routes=open_routes
    )


def add_cors(app: FastAPI, allowed_origins: tuple[str, ...]) -> None:
    """CORS for browser clients from `allowed_origins` (none: no CORS headers at all); added after
    the guard, so it runs outside it: a browser's preflight carries no API key."""
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )


def create_app(state: ServerState, *, close_engine: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if close_engine:
            state.engine.close()

    app = FastAPI(title="polylane", version="0.1.0", lifespan=lifespan)
    app.state.polylane = state
    errors.install(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)

    @app.get("/health", response_model=None)
    @app.get("/health/ready", response_model=None)
    async def ready() -> Any:
        if (reason := state.not_ready_because()) is not None:
            return error_response(503, reason, code="engine_dead" if not state.engine.alive else "not_ready")
        return {"status": "ok", "models": len(state.engine.models)}

    @app.get("/health/live", response_model=None)
    async def live() -> Any:
        if not state.engine.alive:
            return error_response(503, state.engine.error or "the engine is not running", code="engine_dead")
        return {"status": "live"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_guard(app, state.api_key, state.limits.max_body_bytes, state.metrics_public)
    add_cors(app, state.allowed_origins)
    app.add_middleware(AccessLog, count=state.metrics.http_response)  # outermost: refusals are logged too
    openapi.install(
        app,
        state.limits,
        api_key=state.api_key is not None,
        vocab_sizes=lambda: [m.tokenizer.vocab_size for m in state.engine.models.values()],
    )
    return app


def build_state(config: ServerConfig, *, quiet: bool = False) -> ServerState:
    """Start an engine with every declared model registered (fetched now if missing; loaded on use)."""
    engine = Engine(
        EngineConfig(
            budget_bytes=config.budget_bytes,
            scheduler=SchedulerConfig(lane_policy=config.lane_policy),
            eviction=config.eviction,
            quiet=quiet,
            device=config.device,
            threads=config.threads,
        )
    )
    aliases: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    try:
        for model in config.models:
            try:
                engine.add_model(
                    model.name,
                    model.source,
                    dtype=model.dtype,
                    pinned=model.pinned,
                    kv_tokens=model.kv_tokens,
                    speculation=model.speculation,
                )
            except Exception as error:  # a bad file fails only its own model, unless strict
                if config.strict or len(config.models) == 1:
                    raise
                unavailable[model.name] = str(error)
                log.error("model %s is not served: %s", model.name, error)
            aliases.update({alias: model.name for alias in model.aliases})
        if not engine.models:
            raise ValueError("none of the declared models can be served: " + "; ".join(unavailable.values()))
    except BaseException:
        engine.close()
        raise
    return ServerState(
        engine,
        config.limits,
        config.api_key,
        aliases,
        unavailable,
        sampling=dict(config.sampling),
        allowed_origins=config.allowed_origins,
        metrics_public=config.metrics_public,
    )


class StartError(ValueError):
    """`polylane serve` cannot start: the port, or its first model (the message says which and why)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, before any model loads, so a port in use fails at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise StartError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise StartError(
                f"cannot listen on {host}:{port}: the port is in use (choose another with --port)"
            ) from None
        raise StartError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(config: ServerConfig) -> None:
    import uvicorn

    from polylane.runtime.model.compute_paths import version_text

    logs.configure(config.log_level, config.log_format)
    for line in version_text(config.threads).splitlines():
        _say(line)
    listening = listening_socket(config.host, config.port)
    try:
        state = build_state(config)
    except BaseException:
        listening.close()
        raise
    state.ready = False
    first = next(m.name for m in config.models if m.name in state.engine.models)
    exit_cleanly_on_sigterm()
    app_config = uvicorn.Config(create_app(state), log_level=config.log_level, log_config=None)
    server = DrainingServer(app_config, state, config.drain_timeout_s)
    failed: list[str] = []

    # the first model, and every pinned one (pinned: resident from the start, never evicted)
    at_start = [first, *(m.name for m in config.models if m.pinned and m.name in state.engine.models)]

    def load_first() -> None:  # while the server answers (/health: 503 "loading the first model")
        started = time.perf_counter()
        for name in dict.fromkeys(at_start):
            try:
                with state.engine.manager.acquire(name):
                    pass
            except Exception as error:
                failed.append(f"{name} cannot load: {error}")
                server.should_exit = True
                return
        state.ready = True
        _say(f"{', '.join(dict.fromkeys(at_start))} loaded in {time.perf_counter() - started:.1f} s: ready")

    names = ", ".join(m.name for m in config.models if m.name in state.engine.models)
    budget = f"budget {config.budget_bytes / 2**30:.2f} GiB"
    _say(f"serving {names} on http://{config.host}:{config.port}/v1 ({budget}); loading {first} …")
    threading.Thread(target=load_first, name="polylane-first-load", daemon=True).start()
    server.run(sockets=[listening])
    if failed:
        raise StartError(failed[0])


def _say(message: str) -> None:
    log.info(message)
