"""API-key authentication as ASGI middleware (CORS is Starlette's middleware, outside it)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from inference_engine.entrypoints.openai.errors import error_response

__all__ = ["APIKeyMiddleware", "UNPROTECTED_PATHS"]

# Load balancers probe these without credentials (/ping: vLLM's, SageMaker's name).
UNPROTECTED_PATHS = frozenset({"/health", "/ping"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class APIKeyMiddleware:
    """Every HTTP request except :data:`UNPROTECTED_PATHS` needs ``Authorization: Bearer KEY``.

    Keys are compared as SHA-256 digests with :func:`hmac.compare_digest`,
    against every key, so timing reveals neither which key nor how much matched.
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        if not api_keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self.app = app
        self._digests = [_digest(k.encode("utf-8")) for k in api_keys]

    def is_authorized(self, header: bytes | None) -> bool:
        token = b""
        if header is not None:
            scheme, _, value = header.partition(b" ")
            if scheme.lower() == b"bearer":
                token = value.strip()
        given = _digest(token)
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(given, digest)
        return ok and bool(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNPROTECTED_PATHS:
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(given) > 1:  # which one a proxy or a client meant is anyone's guess
            response = error_response("send one Authorization header, not several", 400)
            await response(scope, receive, send)
            return
        header = given[0] if given else None
        if self.is_authorized(header):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer KEY'" if header is None \
            else "invalid API key"
        response = error_response(message, 401, "authentication_error",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
