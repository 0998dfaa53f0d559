"""One polylane replica under Ray Serve: an engine with its own budget, reached through the ingress.

What this module owns: the replica deployment's body (`PolylaneReplica`) and the in-process ASGI
call it runs each forwarded request through (`call_asgi`). A replica builds the single-process
server's state and app (`build_state`, `create_app`) from the same `ServerConfig`, with its own
byte budget and residency manager, and no API key (the ingress checks it; the replica is reached
only through its Ray Serve handle). So validation, protocol, error shapes, SSE and disconnect
handling are the single-process server's own code, not a copy.

Model affinity: a forwarded request carries its model as `serve_multiplexed_model_id`. Before the
request runs, `hold_model` (a `@serve.multiplexed` loader) makes the model resident here, which
tells Ray Serve's router that this replica holds it, so later requests for it come here. Ray keeps
its own list of the models a replica holds and would evict by count; polylane evicts by bytes, so
Ray's count limit is off (-1) and `_forget_evicted` drops from Ray's list any model the residency
manager has evicted since (Ray has no public hook for that; see the note there).

What it does not own: routing, the API key, aggregation over replicas (`server.ray_app`).

Every second (and after each model load) the replica reports its `/v1/models` answer, its
`/metrics` text, its pid and whether its engine is alive to the `ReplicaDirectory` actor, which
the ingress reads to aggregate `/v1/models`, `/metrics` and `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from ray import serve
from starlette.types import ASGIApp, Message

from polylane.server.config import ServerConfig
from polylane.server.errors import error_body

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-polylane-replica"
REPORT_INTERVAL_S = 1.0
DIRECTORY_PREFIX = "polylane-directory"


def directory_name(app_name: str) -> str:
    return f"{DIRECTORY_PREFIX}-{app_name}"


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    """The replicas' latest reports, by replica id. A report older than `max_age_s` is a replica
    that stopped reporting (killed, or being replaced): the readers leave it out."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}

    def report(self, replica: str, report: dict[str, Any]) -> None:
        self._reports[replica] = {**report, "received": time.time()}

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def reports(self, max_age_s: float) -> list[dict[str, Any]]:
        now = time.time()
        for replica in [
            r for r, report in self._reports.items() if now - report["received"] > 10 * max_age_s
        ]:
            del self._reports[replica]
        return [report for report in self._reports.values() if now - report["received"] <= max_age_s]


def get_directory(app_name: str) -> Any:
    """The app's directory actor, created by whoever asks first (detached: it outlives the replica
    or ingress that created it; it goes with the Ray cluster)."""
    return ReplicaDirectory.options(  # type: ignore[attr-defined]
        name=directory_name(app_name), namespace="polylane", lifetime="detached", get_if_exists=True
    ).remote()


# ---------------------------------------------------------------------- in-process ASGI


def _scope(request: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "http",
        # 2.3: Starlette's StreamingResponse then listens on `receive` for the disconnect we send
        # when the caller goes away (2.4 would rely on `send` raising instead).
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        "path": request["path"],
        "raw_path": request["path"].encode(),
        "query_string": request.get("query_string", "").encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
        "client": tuple(request["client"]) if request.get("client") else None,
        "server": None,
        "state": {},
    }


async def call_asgi(
    app: ASGIApp, request: dict[str, Any], extra_headers: Sequence[tuple[str, str]] = ()
) -> AsyncIterator[dict[str, Any]]:
    """Run one HTTP request through `app` in this process; yield its response as plain dicts.

    `request`: {"method", "path", "query_string", "headers": [(name, value)], "body": bytes,
    "client": (host, port) | None}. The first yielded part is {"status", "headers", "body", "more"}
    (the status line and headers travel with the first body bytes, so a caller sees the whole
    response or nothing); the rest are {"body", "more"}. When the caller stops iterating (its
    client went away, or Ray cancelled the call), the app is told `http.disconnect`, so the
    single-process server's disconnect handling aborts the request at the next engine step.
    """
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.get("body", b""), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.put_nowait(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    start: Message | None = None
    started = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                start = message
                continue
            if message["type"] != "http.response.body" or start is None:
                continue
            more = bool(message.get("more_body", False))
            part: dict[str, Any] = {"body": bytes(message.get("body", b"")), "more": more}
            if not started:
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start.get("headers", [])]
                part.update(status=int(start["status"]), headers=headers + list(extra_headers))
                started = True
            yield part
            if not more:
                break
        if not started:  # the app ended without answering: a bug, said in OpenAI's shape
            with contextlib.suppress(BaseException):
                await task
            body = json.dumps(error_body(500, "internal error: the replica gave no response")).encode()
            yield {
                "status": 500,
                "headers": [("content-type", "application/json"), *extra_headers],
                "body": body,
                "more": False,
            }
    finally:
        gone.set()  # a finished app ignores it; a running one learns its client is gone


# ---------------------------------------------------------------------- the deployment body


class PolylaneReplica:
    """A Ray Serve deployment body: one polylane engine and the single-process app over it.

    `forward(request)` is an async generator (call it through a handle with `stream=True`) that
    yields the app's response as `call_asgi` parts; the response's headers carry this replica's id
    (`x-polylane-replica`). Ray Serve builds it (the constructor is async: it starts the reporting
    task on the replica's event loop).
    """

    async def __init__(self, config: ServerConfig, threads: int = 1) -> None:
        from polylane.server.app import build_state, create_app

        context = serve.get_replica_context()
        self.replica_id: str = context.replica_id.unique_id
        self.app_name: str = context.app_name
        # the replica's share of the machine: a fixed count (its engine sets it), or adapt (0)
        self.state = build_state(dataclasses.replace(config, api_key=None, threads=threads), quiet=True)
        self.app = create_app(self.state, close_engine=False)
        self._directory: Any = None
        self._closed = False
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    # ------------------------------------------------------------------ requests

    async def forward(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        model = serve.get_multiplexed_model_id()
        if model:
            try:
                await self.hold_model(model)
            except Exception as error:  # the request itself will fail with the engine's own message
                log.warning("replica %s could not load %s: %s", self.replica_id, model, error)
        try:
            async for part in call_asgi(self.app, request, [(REPLICA_HEADER, self.replica_id)]):
                yield part
        finally:
            self._forget_evicted()

    @serve.multiplexed(max_num_models_per_replica=-1)
    async def hold_model(self, model: str) -> str:
        """Make `model` resident here (Ray then routes its requests to this replica)."""
        await asyncio.to_thread(self._load, model)
        await self._report()
        return model

    def _load(self, model: str) -> None:
        with self.state.engine.manager.acquire(model):
            pass  # resident now; requests take their own leases

    def _forget_evicted(self) -> None:
        """Drop from Ray's list of models held here those the byte budget has evicted since.

        Note: Ray Serve's multiplexing caches models by count and offers no public call to say a
        model left; its per-instance wrapper (`__serve_multiplex_wrapper`, Ray 2.x) keeps them in
        `models` and pushes the list to the router when `_push_multiplexed_replica_info` is set.
        If a Ray version changes that, this does nothing and Ray's view only goes stale: a request
        routed here for an evicted model reloads it, which is still correct.
        """
        wrapper = getattr(self, "__serve_multiplex_wrapper", None)
        models = getattr(wrapper, "models", None)
        if not models:
            return
        held = {info.name for info in self.state.engine.manager.snapshot() if info.state != "cold"}
        for model in [m for m in models if m not in held]:
            models.pop(model, None)
            wrapper._push_multiplexed_replica_info = True  # type: ignore[union-attr]

    # ------------------------------------------------------------------ health and reports

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; a dead engine makes Ray replace the replica."""
        if not self.state.engine.alive:
            raise RuntimeError(self.state.engine.error or "the polylane engine stopped")

    async def _get(self, path: str) -> bytes:
        request = {"method": "GET", "path": path, "headers": [], "body": b""}
        return b"".join([part["body"] async for part in call_asgi(self.app, request)])

    async def _report(self) -> None:
        models = json.loads(await self._get("/v1/models"))
        report = {
            "replica": self.replica_id,
            "pid": os.getpid(),
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "alive": self.state.engine.alive,
            "models": models.get("data", []),
            "metrics": (await self._get("/metrics")).decode(),
        }
        if self._directory is None:
            self._directory = get_directory(self.app_name)
        try:
            await self._directory.report.remote(self.replica_id, report)
        except ray.exceptions.RayError:
            self._directory = None  # asked again next time

    async def _report_forever(self) -> None:
        """Report now (the ingress sees this replica as soon as Ray routes to it), then every
        `REPORT_INTERVAL_S`."""
        while not self._closed:
            try:
                self._forget_evicted()
                await self._report()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # reporting must never take the replica down
                log.warning("replica %s could not report: %s", self.replica_id, error)
            await asyncio.sleep(REPORT_INTERVAL_S)

    def __del__(self) -> None:
        """Ray Serve calls this when it stops the replica gracefully: leave the directory, stop."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._reporter.cancel()
        if self._directory is not None:
            with contextlib.suppress(Exception):
                self._directory.forget.remote(self.replica_id)
        self.state.engine.close()
