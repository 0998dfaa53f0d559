"""The OpenAPI document (`GET /openapi.json`): what the server does, status by status.

What this module owns: rewriting FastAPI's generated document so that it describes the server as
it behaves. FastAPI documents every operation as 200 or 422; here a validation error is a 400,
and each route lists the statuses it can answer with (400, 401 when an API key is set, 404, 409,
413, 429, 503) in OpenAI's error shape (`ErrorResponse`), with `Retry-After` where it is sent. The
completion routes answer JSON or, when `stream` is true, `text/event-stream`; `/metrics` answers
Prometheus text; `/health` 200 or 503. Limits the server enforces from its configuration and its
models (`n` up to `limits.max_n`, a prompt's token ids below the largest served vocabulary; each
model's own is its `vocab_size` in /v1/models) are written into the request schemas, next to those
the request models carry themselves (stop strings, messages, ranges). `tests/server/test_openapi.py`
runs schemathesis against a live server with its response-conformance checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from polylane.server.config import Limits

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}
RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}
}
ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_ERROR_TEXT = {
    400: "invalid request (a field named in `param`), or a prompt past the model's context",
    401: "missing or wrong API key",
    404: "no such model, or no such route",
    405: "method not allowed on this route",
    409: "the model is in use (evict, budget)",
    413: "the request body is larger than limits.max_body_bytes",
    429: "the queue is full (limits.max_waiting_requests or max_waiting_tokens)",
    503: "the server ended the request without an answer (deadline, queue timeout, model failed, shutdown)",
}
COMPLETION_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": "object"},
    },
}
# operation → statuses besides 200 (and 401 with an API key, 404 and 405 for every route)
ERRORS = {
    ("/v1/completions", "post"): (400, 413, 429, 503),
    ("/v1/chat/completions", "post"): (400, 413, 429, 503),
    ("/v1/models", "get"): (),
    ("/v1/models/{name}", "get"): (503,),
    ("/admin/models", "get"): (),
    ("/admin/models/{name}/load", "post"): (409, 503),
    ("/admin/models/{name}/pin", "post"): (),
    ("/admin/models/{name}/unpin", "post"): (),
    ("/admin/models/{name}/evict", "post"): (400, 409),
    ("/admin/budget", "post"): (400, 409, 413),
    ("/health", "get"): (503,),
    ("/health/ready", "get"): (503,),
    ("/health/live", "get"): (503,),
    ("/metrics", "get"): (),
}
RETRIED = (429, 503)


def install(app: FastAPI, limits: Limits, api_key: bool, vocab_sizes: Callable[[], list[int]]) -> None:
    """Serve the rewritten document at /openapi.json (built once, on the first request);
    `vocab_sizes`: the served models' vocabularies (a prompt's token ids lie below its model's)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = rewrite(document, limits, api_key, max(vocab_sizes(), default=0))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def rewrite(document: dict[str, Any], limits: Limits, api_key: bool, vocab_size: int) -> dict[str, Any]:
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        if name in components:
            components[name]["properties"]["n"]["maximum"] = limits.max_n
    prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for form in prompt.get("anyOf", []):
        items = form.get("items", {})
        if items.get("type") == "array":  # a batch of token-id prompts
            items = items.get("items", {})
        if form.get("type") == "array" and items.get("type") == "integer" and vocab_size:
            items["maximum"] = vocab_size - 1
            items["description"] = "a token id, below the model's vocabulary (`vocab_size` in /v1/models)"
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            statuses = ERRORS.get((path, method), (400,))
            responses = operation["responses"]
            responses.pop("422", None)
            ok = responses.setdefault("200", {"description": "OK"})
            if path in ("/v1/completions", "/v1/chat/completions"):
                ok["description"] = "the completion (JSON), or its server-sent events when `stream` is true"
                ok["content"] = {
                    "application/json": {"schema": COMPLETION_SCHEMA},
                    "text/event-stream": {"schema": {"type": "string"}},
                }
            elif path == "/metrics":
                ok["description"] = "Prometheus text exposition"
                ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
            elif path.startswith("/health"):
                ok["content"] = {"application/json": {"schema": {"type": "object"}}}
            for status in (
                *statuses,
                *((401,) if api_key and not path.startswith("/health") else ()),
                404,
                405,
            ):
                response: dict[str, Any] = {"description": _ERROR_TEXT[status], "content": ERROR_CONTENT}
                if status in RETRIED:
                    response["headers"] = RETRY_AFTER
                responses[str(status)] = response
    return document
