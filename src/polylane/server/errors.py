"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the right status.

What this module owns: `ApiError` (raised by routes), the exception handlers that turn validation
errors, unknown routes and anything unexpected into that shape, and the rule that an error message
never echoes the request body back (pydantic's `input` is dropped; only the field and the reason).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


# The code of an error raised without one of its own: no error leaves the server with a null code.
_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_value",
    429: "rate_limit_exceeded",
    499: "client_closed",
    500: "internal_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code or _CODES.get(status, "error"),
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field(loc: tuple[Any, ...]) -> str | None:
    # pydantic names union branches in the location ("str", "list[int]", "constrained-str",
    # "function-after[...]"); keep the field path only: field names and list indexes.
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS)
    ]
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _field(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", None, "invalid_json")
        reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"{param}: {reason}" if param else reason
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else "request refused"
        code = None
        if error.status_code == 404:
            message, code = "no such route", "route_not_found"
        return error_response(error.status_code, message, code=code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:  # a bug: say so, stay up
        log.exception("unexpected error while serving a request")
        return error_response(500, f"internal error: {type(error).__name__}", None, "internal_error")
