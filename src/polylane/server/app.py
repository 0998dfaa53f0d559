"""Wiring: the FastAPI app over one engine, its guards, and `serve()` behind `polylane serve`.

What this module owns: building the app (routes, error handlers), the two guards every request
passes first (the API key, compared in constant time, on every route but `/health`; the body size
limit, 413 before the body is parsed, whether or not the client sent a Content-Length), `/health`
(503 once the engine is dead) and `/metrics`, and starting the engine with its declared models.
"""

from __future__ import annotations

import hmac
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from polylane.engine import Engine, EngineConfig
from polylane.policy.scheduler import SchedulerConfig
from polylane.server import errors, openapi, routes_admin, routes_openai
from polylane.server.config import ServerConfig
from polylane.server.errors import error_response
from polylane.server.shutdown import DrainingServer, exit_cleanly_on_sigterm
from polylane.server.state import ServerState

log = logging.getLogger(__name__)
OPEN_ROUTES = ("/health",)


class GuardMiddleware:
    """API key and body size, checked before any route runs (pure ASGI, so streaming is untouched)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_ROUTES:
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
    async def health() -> Any:
        if not state.engine.alive:
            return error_response(503, state.engine.error or "the engine is not running", code="engine_dead")
        return {"status": "ok", "models": len(state.engine.models)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(GuardMiddleware, api_key=state.api_key, max_body_bytes=state.limits.max_body_bytes)
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
                print(f"polylane: {model.name} is not served: {error}", file=sys.stderr, flush=True)
            aliases.update({alias: model.name for alias in model.aliases})
        if not engine.models:
            raise ValueError("none of the declared models can be served: " + "; ".join(unavailable.values()))
    except BaseException:
        engine.close()
        raise
    return ServerState(engine, config.limits, config.api_key, aliases, unavailable)


def serve(config: ServerConfig) -> None:
    import uvicorn

    from polylane.runtime.compute_paths import version_text

    for line in version_text(config.threads).splitlines():
        print(f"polylane: {line}", file=sys.stderr, flush=True)
    state = build_state(config)
    first = next(m.name for m in config.models if m.name in state.engine.models)
    started = time.perf_counter()
    print(f"polylane: loading {first} …", file=sys.stderr, flush=True)
    try:
        with state.engine.manager.acquire(first):
            pass  # the first model is ready before the port opens
    except Exception as error:  # keep serving the others; the first request will say why
        print(f"polylane: {first} failed to load: {error}", file=sys.stderr, flush=True)
    else:
        print(
            f"polylane: {first} loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True
        )
    names = ", ".join(m.name for m in config.models if m.name in state.engine.models)
    print(
        f"polylane: serving {names} on http://{config.host}:{config.port}/v1 "
        f"(budget {config.budget_bytes / 2**30:.2f} GiB)",
        file=sys.stderr,
        flush=True,
    )
    exit_cleanly_on_sigterm()
    app = create_app(state)
    server_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning")
    DrainingServer(server_config, state, config.drain_timeout_s).run()
