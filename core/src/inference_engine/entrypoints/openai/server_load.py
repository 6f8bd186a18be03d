"""vLLM's ``GET /load``: how many generation requests the server is handling right now."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ServerLoad", "ServerLoadMiddleware"]

# The routes that put work on the model (vLLM counts its generation and pooling routes).
_COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class ServerLoad:
    """The count ``/load`` reports as ``server_load`` (load balancers route on it)."""

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoadMiddleware:
    """Counts a generation request from arrival until its response, streamed or whole, has
    been sent (or the client has gone)."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _COUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1
