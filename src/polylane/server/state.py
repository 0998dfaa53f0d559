"""What every route shares: the engine, the limits, the name registry, admission and metrics.

Model names a client sends are resolved here, through the registry of declared names and aliases,
never used as paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polylane.engine import Engine
from polylane.server.admission import Admission
from polylane.server.config import Limits
from polylane.server.errors import ApiError
from polylane.server.metrics import ServerMetrics
from polylane.types import SamplingDefaults


@dataclass
class ServerState:
    engine: Engine
    limits: Limits
    api_key: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # alias → served model name
    unavailable: dict[str, str] = field(default_factory=dict)  # declared, failed at start → why
    open_handles: set = field(default_factory=set)  # the RequestHandles of requests not yet ended
    sampling: dict[str, float | int] = field(default_factory=dict)  # serve's --temperature etc.
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins that may call the API (none: off)
    metrics_public: bool = False  # /metrics answers without the API key (serve --metrics-public)
    ready: bool = True  # `serve()` clears it until its first model has loaded
    draining: bool = False  # set once shutdown begins: not ready for new traffic, still live
    admission: Admission = field(init=False)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.limits.max_waiting_requests, self.limits.max_waiting_tokens)
        self.metrics = ServerMetrics(self.engine, self.admission)

    def sampling_defaults(self, model: str) -> SamplingDefaults:
        """What `model`'s requests get for the sampling fields they leave unset."""
        return self.engine.models[model].sampling.override(source="serve's flags", **self.sampling)

    def not_ready_because(self) -> str | None:
        """Why the server should get no new traffic now (a readiness probe's 503), or None."""
        if not self.engine.alive:
            return self.engine.error or "the engine is not running"
        if self.draining:
            return "shutting down"
        if not self.ready:
            return "loading the first model"
        return None

    def resolve(self, name: str) -> str:
        served = self.engine.models
        canonical = self.aliases.get(name, name)
        if canonical in self.unavailable:
            raise ApiError(
                503,
                f"model {canonical!r} is declared but not served: it failed at start "
                f"({self.unavailable[canonical][:300]})",
                param="model",
                code="model_unavailable",
            )
        if canonical not in served:
            names = sorted([*served, *self.aliases])
            raise ApiError(
                404,
                f"model {name[:100]!r} does not exist here; served models: {', '.join(names) or 'none'}",
                param="model",
                code="model_not_found",
            )
        return canonical

    def aliases_of(self, name: str) -> list[str]:
        return sorted(alias for alias, target in self.aliases.items() if target == name)
