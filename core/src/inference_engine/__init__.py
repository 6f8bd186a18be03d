"""inference-engine: a plugin-based LLM inference and serving engine.

Only the public API lives here; heavy modules load on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inference_engine.hookspecs import hookimpl
from inference_engine.registry import Spec

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "LoRARequest", "RequestOutputKind", "SamplingParams", "Spec",
           "__version__", "hookimpl"]

_LAZY = {
    "LLM": "inference_engine.entrypoints.llm",
    "AsyncLLM": "inference_engine.engine.async_client",
    "SamplingParams": "inference_engine.sampling_params",
    "RequestOutputKind": "inference_engine.sampling_params",
    "LoRARequest": "inference_engine.lora.request",
}

if TYPE_CHECKING:
    from inference_engine.engine.async_client import AsyncLLM
    from inference_engine.entrypoints.llm import LLM
    from inference_engine.lora.request import LoRARequest
    from inference_engine.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'inference_engine' has no attribute {name!r}")
