"""The server's log: its level, text or JSON lines, and one access line per HTTP request.

What this module owns: `configure()` (called by `serve()`: every `polylane.*` logger and uvicorn's
write to stderr at `--log-level`, as text or, with `--log-format json`, one JSON object per line)
and `AccessLog`, the ASGI middleware that writes, at info (probes and scrapes that succeed: at
debug), each request's method, route, status,
model, prompt and completion tokens, time to first token and total milliseconds (the completion
routes leave the model's part in `request.state.polylane_access`), and counts responses by route
and status for `/metrics`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
QUIET_ROUTES = ("/health", "/health/live", "/health/ready", "/metrics")
log = logging.getLogger("polylane.access")


class JsonLines(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "info", format: str = "text") -> None:
    """polylane's and uvicorn's loggers to stderr at `level`, as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    if format == "json":
        handler.setFormatter(JsonLines())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s polylane: %(message)s", "%Y-%m-%d %H:%M:%S")
        )
    for name in ("polylane", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # AccessLog writes the richer line


class AccessLog:
    """Logs each HTTP request once its response has ended (a stream: after its last event)."""

    def __init__(self, app: ASGIApp, count: Any = None) -> None:
        self.app, self.count = app, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        scope.setdefault("state", {})

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            if self.count is not None:
                self.count(route, status)
            self._write(scope, route, status, (time.perf_counter() - started) * 1000)

    @staticmethod
    def _write(scope: Scope, route: str, status: int, total_ms: float) -> None:
        level = logging.DEBUG if route in QUIET_ROUTES and status < 400 else logging.INFO  # probes, scrapes
        if not log.isEnabledFor(level):
            return
        fields: dict[str, Any] = {
            "method": scope["method"],
            "path": scope["path"],
            "route": route,
            "status": status,
        }
        fields.update(scope["state"].get("polylane_access", {}))
        fields["total_ms"] = round(total_ms, 1)
        parts = [f"{fields['method']} {fields['path']} {status}"]
        if "model" in fields:
            ttft = fields.get("ttft_ms")
            parts.append(
                f"model={fields['model']} prompt={fields['prompt_tokens']} "
                f"completion={fields['completion_tokens']} ttft_ms={'-' if ttft is None else f'{ttft:.0f}'}"
            )
        parts.append(f"total_ms={total_ms:.0f}")
        log.log(level, " ".join(parts), extra={"fields": fields})
