"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["APIError", "InternalErrorMiddleware", "JSONResponse", "error_body",
           "error_response"]

logger = logging.getLogger(__name__)

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


class InternalErrorMiddleware:
    """Turns an unhandled exception into a 500 in the OpenAI shape, inside auth and CORS.

    Starlette's own last-resort handler sits outside every middleware (no CORS
    headers) and re-raises, so the server drops the keep-alive connection
    without saying ``Connection: close``; this one answers like any other
    error. The message names the exception type only: details go to the log.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:  # headers are out: nothing well-formed can be sent any more
                raise
            response = error_response(f"internal error ({type(exc).__name__}); the server log "
                                      "has the details", 500)
            await response(scope, receive, send)
