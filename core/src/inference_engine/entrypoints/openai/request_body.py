"""Reading a request's body: a size limit checked while it streams in, then JSON.

Used by every route that parses its own body (the OpenAI routes, the LoRA admin routes).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from inference_engine.entrypoints.openai.errors import APIError

__all__ = ["decode_json", "read_body", "read_json"]


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; 413 as soon as it passes ``limit`` bytes (the rest is never read)."""
    length = request.headers.get("content-length", "")
    too_large = APIError(f"the request body is larger than {limit} bytes", status=413)
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(body: bytes) -> Any:
    """The decoded JSON body; a 400 naming the problem if it is empty or not JSON."""
    if not body.strip():
        raise APIError("the request body is empty; send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None


async def read_json(request: Request, limit: int) -> Any:
    return decode_json(await read_body(request, limit))
