"""Server-Sent Events framing and a streaming response that always releases its requests."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from inference_engine.entrypoints.openai.errors import APIError, error_body

__all__ = ["DONE", "EngineStreamingResponse", "sse", "sse_error"]

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


# Characters that Python's str.splitlines (and so many line readers) treat as line
# breaks. JSON allows them raw inside strings; escaping them keeps each event on one
# line for every client. They can only occur inside JSON strings, so bytes-replacing is safe.
_LINE_BREAKS = tuple((ch.encode(), f"\\u{ord(ch):04x}".encode())
                     for ch in ("\u0085", "\u2028", "\u2029"))


def sse(payload: dict[str, Any]) -> bytes:
    """One ``data: {...}`` event."""
    data = orjson.dumps(payload)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    """The error event sent when a stream fails after it began (status is already 200)."""
    if isinstance(exc, APIError):
        body = error_body(exc.message, exc.status, exc.type, exc.param)
    else:
        body = error_body(f"internal error: {exc}", 500)
    return sse(body)


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends (done, error, disconnect).

    ``on_close`` aborts whatever engine requests are still unfinished, so a
    client that goes away before (or while) the body streams frees its KV blocks.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()  # type: ignore[attr-defined]
            except Exception:  # already closed or never started
                pass
            try:
                await self._on_close()
            except Exception:
                logger.debug("releasing a stream's requests failed", exc_info=True)
