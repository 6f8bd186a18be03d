"""LoRA adapters on the OpenAI server: each adapter is a model name, selected by ``model``.

Adapters come from ``--lora-modules name=path`` (read and checked at start-up)
and from ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` with
vLLM's bodies (``{"lora_name", "lora_path"}`` and ``{"lora_name"}``); those
routes sit behind the API key like every other route but ``/health``.
"""

from __future__ import annotations

import itertools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from inference_engine.entrypoints.openai.errors import APIError
from inference_engine.entrypoints.openai.protocol import parse_body
from inference_engine.lora.request import LoRARequest

__all__ = ["LoadLoRAAdapterRequest", "ServedLoRAs", "UnloadLoRAAdapterRequest",
           "add_lora_routes"]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_int_id: int | None = None


class ServedLoRAs:
    """The adapters a server offers, by model name.

    Args:
        engine: the server's ``AsyncLLM``.
        base_names: the base model's served names (an adapter may not take one).
    """

    def __init__(self, engine: Any, base_names: list[str]) -> None:
        self.engine = engine
        self.enabled = engine.engine.lora is not None
        self.base_names = list(base_names)
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add_at_startup(self, modules: dict[str, str]) -> None:
        """Read and check ``--lora-modules`` before serving (the engine is idle).

        Raises:
            ValueError: LoRA is off, a name is taken, or what is wrong with an adapter.
        """
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in modules.items():
            request = self._new_request(name, path)
            self.engine.engine.add_lora(request)
            self.adapters[name] = request

    def _new_request(self, name: str, path: str) -> LoRARequest:
        if name in self.adapters or name in self.base_names:
            raise ValueError(f"the model name {name!r} is already in use")
        return LoRARequest(name, next(self._ids), path)

    def lookup(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names, or None (the base model or an unknown name)."""
        return None if model is None else self.adapters.get(model)

    def model_cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters (vLLM's: root is the path, parent the base)."""
        return [{"id": name, "object": "model", "created": created,
                 "owned_by": "inference-engine", "root": request.lora_path,
                 "parent": self.base_names[0], "max_model_len": max_model_len}
                for name, request in self.adapters.items()]

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise APIError("LoRA is not enabled on this server (start it with --enable-lora)")

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        self._check_enabled()
        if body.lora_name in self.adapters:
            raise APIError(f"the LoRA adapter {body.lora_name!r} has already been loaded",
                           param="lora_name")
        try:
            request = self._new_request(body.lora_name, body.lora_path)
            await self.engine.add_lora(request)
        except ValueError as exc:
            raise APIError(str(exc), param="lora_path") from None
        self.adapters[body.lora_name] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        self._check_enabled()
        request = self.adapters.get(body.lora_name)
        if request is None or (body.lora_int_id is not None
                               and body.lora_int_id != request.lora_int_id):
            raise APIError(f"the LoRA adapter {body.lora_name!r} is not loaded", status=404,
                           param="lora_name")
        del self.adapters[body.lora_name]
        await self.engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def add_lora_routes(app: FastAPI, loras: ServedLoRAs) -> None:
    """``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = parse_body(LoadLoRAAdapterRequest, await _json(request))
        return PlainTextResponse(await loras.load(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = parse_body(UnloadLoRAAdapterRequest, await _json(request))
        return PlainTextResponse(await loras.unload(body))


async def _json(request: Request) -> Any:
    from inference_engine.entrypoints.openai.request_body import read_json

    return await read_json(request, 1 << 16)
