"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["APIError", "JSONResponse", "error_body", "error_response"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}


class JSONResponse(Response):
    """A JSON response encoded with orjson (several times faster than the stdlib)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class APIError(Exception):
    """A request that cannot be served; becomes a 4xx/5xx in the OpenAI error shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else
                                        "invalid_request_error")


def error_body(message: str, status: int, type_: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object; ``code`` is the HTTP status, as vLLM sends it."""
    return {"error": {
        "message": message,
        "type": type_ or _TYPES.get(status, "server_error" if status >= 500 else
                                    "invalid_request_error"),
        "param": param,
        "code": status,
    }}


def error_response(message: str, status: int = 400, type_: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error_body(message, status, type_, param), status_code=status,
                        headers=headers)


def from_api_error(exc: APIError) -> Response:
    return error_response(exc.message, exc.status, exc.type, exc.param)


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"
