"""Past one machine: polylane replicas under Ray Serve, routed by model (`polylane serve --ray`).

What this module owns: the Ray Serve application. N `PolylaneReplica`s (`server.ray_replica`), each
one polylane engine with its own byte budget and residency manager, sit behind one ingress
deployment (`PolylaneIngress`) that Ray Serve's HTTP proxy sends every request to. The ingress:

- checks the API key and the body size with the single-process server's `GuardMiddleware`;
- reads the OpenAI `model` field (resolving aliases to the served name) and forwards the raw
  request to a replica with that name as `serve_multiplexed_model_id`, so Ray Serve's model
  multiplexing picks a replica that already holds the model, or else the replica with the fewest
  models (the least loaded) for it to load there; a request without a known model goes to any
  replica, whose app answers it exactly as the single-process server would (400, 404 …);
- answers `/v1/models`, `/metrics` and `/health` from the replicas' reports (`ReplicaDirectory`,
  sent every second, so up to a second old): `/v1/models` lists each model once with its state on
  every replica, `/metrics` is every replica's Prometheus text with a `replica` label, `/health`
  is 200 while a replica is alive;
- turns a replica that dies under a request into a clear error: a 503 in OpenAI's error shape
  (with Retry-After) if no byte was sent yet, else a final SSE error event and `data: [DONE]`.
  Ray Serve replaces the dead replica (health checks every `health_check_period_s`).

What it does not own: validation, the wire format, SSE, disconnects: the replicas run the
single-process app (`server.app.create_app`) on each forwarded request. Admin routes act on one
engine, so the ingress refuses them with a 404 that says so.

`--budget` is per replica (`auto`: half of the free RAM shared among the replicas), and so are the
admission limits (429 past `max_waiting_requests` on a replica).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from polylane.server import errors
from polylane.server.app import add_cors, add_guard
from polylane.server.config import ServerConfig
from polylane.server.errors import ApiError, error_body, error_response
from polylane.server.ray_replica import PolylaneReplica, get_directory

REPORT_MAX_AGE_S = 3.0  # a replica silent for longer is left out of /v1/models, /metrics, /health
_STATE_RANK = {"cold": 0, "loading": 1, "resident": 2}
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}


@dataclass(frozen=True)
class RayOptions:
    replicas: int = 2
    cpus_per_replica: float = 1.0  # Ray CPUs each replica reserves
    threads_per_replica: int = 1  # torch threads in each replica's engine
    app_name: str = "polylane"
    health_check_period_s: float = 1.0  # how soon Ray notices a dead replica and replaces it

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.cpus_per_replica < 0:
            raise ValueError(f"cpus_per_replica must be >= 0, got {self.cpus_per_replica}")


def replica_failed(error: BaseException) -> dict[str, Any]:
    """The OpenAI error body for a request whose replica died (or could not be reached)."""
    reason = type(error).__name__
    return error_body(
        503,
        f"the replica serving this request stopped before it finished ({reason}); Ray Serve is "
        "replacing it: retry the request",
        None,
        "replica_failed",
    )


class PolylaneIngress:
    """The ingress deployment body (wrapped by `serve.ingress()`): one ASGI app built at replica
    start from the config, forwarding to the replicas' handle."""

    def __init__(self, replicas: DeploymentHandle, config: ServerConfig, app_name: str) -> None:
        self.replicas = replicas
        self.config = config
        self.app_name = app_name
        self.names = {m.name: m.name for m in config.models} | {
            alias: m.name for m in config.models for alias in m.aliases
        }
        self._directory: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        return create_ingress_app(self)

    # ------------------------------------------------------------------ routing

    def model_id(self, body: bytes) -> str:
        """The served name the request's `model` field resolves to, or "" (then any replica)."""
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return ""
        name = data.get("model") if isinstance(data, dict) else None
        return self.names.get(name, "") if isinstance(name, str) else ""

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        forwarded = {
            "method": request.method,
            "path": request.url.path,
            "query_string": request.url.query,
            "headers": [(k, v) for k, v in request.headers.items() if k != "authorization"],
            "body": body,
            "client": (request.client.host, request.client.port) if request.client else None,
        }
        handle = self.replicas.options(stream=True, multiplexed_model_id=self.model_id(body))
        responses: DeploymentResponseGenerator = handle.forward.remote(forwarded)
        try:
            first = await responses.__anext__()
        except asyncio.CancelledError:  # the client went away: stop the replica's work too
            responses.cancel()
            raise
        except Exception as error:  # includes StopAsyncIteration: a replica that gave nothing
            responses.cancel()
            return _json(503, replica_failed(error), {"Retry-After": "1"})
        headers = {k: v for k, v in first["headers"] if k.lower() not in _HOP_HEADERS}
        if not first["more"]:
            return Response(first["body"], status_code=first["status"], headers=headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(
            _rest(responses, first["body"], sse), status_code=first["status"], headers=headers
        )

    # ------------------------------------------------------------------ the replicas' reports

    async def reports(self) -> list[dict[str, Any]]:
        for attempt in range(2):
            if self._directory is None:
                self._directory = get_directory(self.app_name)
            try:
                return await self._directory.reports.remote(REPORT_MAX_AGE_S)
            except ray.exceptions.RayError:
                self._directory = None
                if attempt:
                    raise
        return []

    def declared_order(self, name: str) -> int:
        order = [m.name for m in self.config.models]
        return order.index(name) if name in order else len(order)


async def _rest(responses: DeploymentResponseGenerator, first: bytes, sse: bool) -> Any:
    """The body after the first part; a replica that dies mid-stream ends an SSE stream with an
    error event and `data: [DONE]` (other bodies arrive whole, in the first part)."""
    finished = False
    try:
        yield first
        async for part in responses:
            yield part["body"]
            if not part["more"]:
                finished = True
                return
    except asyncio.CancelledError:
        raise
    except Exception as error:
        finished = True
        if not sse:
            raise
        yield f"data: {json.dumps(replica_failed(error))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: the replica aborts the request at its next step
            responses.cancel()


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


def aggregate_models(reports: list[dict[str, Any]], order: Any = None) -> list[dict[str, Any]]:
    """Each model once, from every replica's `/v1/models` entries: `state` is the best over the
    replicas (resident > loading > cold) with that copy's `bytes`; `in_flight` is the sum;
    `replicas` lists every replica's own state, bytes and in-flight count."""
    models: dict[str, dict[str, Any]] = {}
    for report in sorted(reports, key=lambda r: r["replica"]):
        for entry in report["models"]:
            own = {k: entry[k] for k in ("state", "bytes", "in_flight", "pinned")}
            merged = models.get(entry["id"])
            if merged is None:
                merged = models[entry["id"]] = {**entry, "in_flight": 0, "replicas": []}
            elif _STATE_RANK.get(entry["state"], 0) > _STATE_RANK.get(merged["state"], 0):
                merged["state"], merged["bytes"] = entry["state"], entry["bytes"]
            merged["in_flight"] += entry["in_flight"]
            merged["pinned"] = merged["pinned"] or entry["pinned"]
            merged["replicas"].append({"replica": report["replica"], **own})
    return sorted(models.values(), key=lambda m: (order or (lambda _: 0))(m["id"]))


def merge_metrics(reports: list[dict[str, Any]]) -> str:
    """Every replica's Prometheus text as one exposition: samples get a `replica` label and each
    metric family's HELP/TYPE lines appear once, followed by all replicas' samples."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for report in sorted(reports, key=lambda r: r["replica"]):
        label = f'replica="{report["replica"]}"'
        family = ""
        for line in report["metrics"].splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                header, _ = families.setdefault(family, ([], []))
                if line not in header:
                    header.append(line)
                continue
            if not line or line.startswith("#"):
                continue
            name, brace, rest = line.partition("{")
            if brace:
                sample = f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
            else:
                metric, _, value = line.partition(" ")
                sample = f"{metric}{{{label}}} {value}"
            families.setdefault(family, ([], []))[1].append(sample)
    return "".join("\n".join([*header, *samples]) + "\n" for header, samples in families.values())


def create_ingress_app(ingress: PolylaneIngress) -> FastAPI:
    config = ingress.config
    app = FastAPI(title="polylane (Ray Serve ingress)", version="0.1.0")
    errors.install(app)

    @app.get("/health", response_model=None)
    @app.get("/health/ready", response_model=None)
    @app.get("/health/live", response_model=None)
    async def health() -> Any:
        alive = [r for r in await ingress.reports() if r["alive"]]
        if not alive:
            return error_response(503, "no polylane replica is alive", code="engine_dead")
        return {"status": "ok", "replicas": len(alive), "models": len(config.models)}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        reports = await ingress.reports()
        if not reports:
            raise ApiError(503, "no polylane replica has reported yet", code="no_replica")
        return {"object": "list", "data": aggregate_models(reports, ingress.declared_order)}

    @app.get("/v1/models/{name}")
    async def retrieve_model(name: str) -> dict[str, Any]:
        reports = await ingress.reports()
        canonical = next((m.name for m in config.models if name == m.name or name in m.aliases), name)
        for model in aggregate_models(reports, ingress.declared_order):
            if model["id"] == canonical:
                return model
        raise ApiError(
            404, f"model {name[:100]!r} does not exist here", param="model", code="model_not_found"
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        text = merge_metrics(await ingress.reports())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/admin/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def admin(path: str) -> Any:
        raise ApiError(
            404,
            "admin routes act on one engine; under Ray Serve each replica has its own budget and "
            "residency, so they are not served here (see /v1/models for each replica's state)",
            code="not_available_under_ray",
        )

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(request: Request) -> Response:
        return await ingress.forward(request)

    add_guard(app, config.api_key, config.limits.max_body_bytes, config.metrics_public)
    add_cors(app, config.allowed_origins)
    return app


# ---------------------------------------------------------------------- building and serving


def build_application(config: ServerConfig, options: RayOptions) -> Any:
    """The Ray Serve application: `options.replicas` polylane replicas behind one ingress."""
    per_replica = config.limits.max_waiting_requests
    replica = serve.deployment(PolylaneReplica).options(
        name="PolylaneReplica",
        num_replicas=options.replicas,
        max_ongoing_requests=per_replica,
        ray_actor_options={"num_cpus": options.cpus_per_replica},
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=10,
        graceful_shutdown_wait_loop_s=0.5,
    )
    ingress = serve.deployment(serve.ingress()(PolylaneIngress)).options(
        name="PolylaneIngress",
        num_replicas=1,
        max_ongoing_requests=per_replica * options.replicas,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=0.5,
    )
    return ingress.bind(replica.bind(config, options.threads_per_replica), config, options.app_name)


def fit_to_cluster(options: RayOptions) -> RayOptions:
    """Replicas that together ask for more CPUs than the cluster has would never start: share the
    cluster's CPUs among them instead (with a note)."""
    cpus = float(ray.cluster_resources().get("CPU", 0))
    if cpus and options.replicas * options.cpus_per_replica > cpus:
        share = cpus / options.replicas
        print(
            f"polylane: {options.replicas} replicas x {options.cpus_per_replica:g} CPUs exceed the "
            f"cluster's {cpus:g}; each replica reserves {share:g}",
            file=sys.stderr,
            flush=True,
        )
        return RayOptions(
            options.replicas,
            share,
            options.threads_per_replica,
            options.app_name,
            options.health_check_period_s,
        )
    return options


def serve_ray(config: ServerConfig, options: RayOptions) -> None:
    """Start (or join, with $RAY_ADDRESS) a Ray cluster and serve until interrupted."""
    ray.init(include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    options = fit_to_cluster(options)
    serve.start(http_options={"host": config.host, "port": config.port})
    started = time.perf_counter()
    print(f"polylane: starting {options.replicas} replicas under Ray Serve …", file=sys.stderr, flush=True)
    serve.run(build_application(config, options), name=options.app_name, route_prefix="/")
    names = ", ".join(m.name for m in config.models)
    print(
        f"polylane: serving {names} on http://{config.host}:{config.port}/v1 with {options.replicas} "
        f"replicas (budget {config.budget_bytes / 2**30:.2f} GiB each; ready in "
        f"{time.perf_counter() - started:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if os.environ.get("RAY_ADDRESS"):  # a shared cluster: remove our app only, then disconnect
            serve.delete(options.app_name)
        else:
            serve.shutdown()
        ray.shutdown()
