"""What ``inference-engine quantize --method NAME`` writes for one linear weight, per method.

:data:`EXPORTERS` maps the ``--method`` name to a :class:`QuantExporter`; a
method plugs in with :func:`register_exporter` (the MX/NVFP4 methods add
theirs from their own modules, listed in :data:`EXPORTER_MODULES` so the CLI
imports them). An exporter turns one checkpoint weight ``[N, K]`` into the
tensors a real checkpoint of that format stores for it (names relative to
the module, e.g. ``weight`` and ``weight_scale_inv``) and says what goes in
``config.json``'s ``quantization_config``.

FP8 exporters write the engine's (K, N) layout by default: every tensor of the
layer transposed (``weight [K, N]``, block scales ``[ceil(K/128), ceil(N/128)]``)
and ``"weight_layout": "KN"`` in the config. ``layout="NK"`` writes the
standard HF/vLLM layout instead, which other engines and transformers load.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inference_engine_quant.fp8_math import (
    quantize_weight_blockwise,
    quantize_weight_per_tensor,
)

__all__ = [
    "EXPORTERS",
    "EXPORTER_MODULES",
    "QuantExporter",
    "get_exporter",
    "is_decoder_linear_weight",
    "register_exporter",
]

# Decoder linear weights: attention and MLP/expert projections of model.layers.N.
_DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\..*_proj\.weight$")


def is_decoder_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """Whether online/offline quantization applies: a 2-D ``*_proj.weight`` inside a decoder layer.

    Embeddings, the LM head, norms, routers (``mlp.gate``) and biases are never selected.
    """
    return tensor.dim() == 2 and bool(_DECODER_LINEAR.search(name))


@dataclass(frozen=True)
class QuantExporter:
    """How one ``--method`` writes its checkpoint."""

    # The --method value.
    name: str
    # (module name, weight [N, K], layout) -> {tensor name relative to the module: tensor}.
    quantize_weight: Callable[[str, torch.Tensor, str], dict[str, torch.Tensor]]
    # (layout) -> the quantization_config dict for config.json.
    quantization_config: Callable[[str], dict[str, Any]]
    # Layouts this exporter can write; the first is the default.
    layouts: tuple[str, ...] = ("KN", "NK")
    # One line for --help.
    description: str = ""
    # Which tensors it quantizes (name, tensor) -> bool.
    selects: Callable[[str, torch.Tensor], bool] = field(default=is_decoder_linear_weight)
    # Extra files to write next to config.json: (layout) -> {file name: text}.
    extra_files: Callable[[str], dict[str, str]] | None = None


EXPORTERS: dict[str, QuantExporter] = {}

# Modules that call register_exporter when imported (other methods append theirs).
EXPORTER_MODULES: list[str] = ["inference_engine_quant.quantize_exporters",
                               "inference_engine_quant.mx_export"]


def register_exporter(exporter: QuantExporter) -> None:
    """Add an exporter; a second one with the same name is an error."""
    if exporter.name in EXPORTERS and EXPORTERS[exporter.name] is not exporter:
        raise ValueError(f"quantize exporter {exporter.name!r} is registered twice")
    EXPORTERS[exporter.name] = exporter


def get_exporter(name: str) -> QuantExporter:
    """The exporter for ``--method name``, importing every exporter module first.

    Raises:
        ValueError: naming the methods that exist.
    """
    for module in EXPORTER_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            continue  # a method whose module is absent in this build
    if name not in EXPORTERS:
        raise ValueError(f"unknown --method {name!r}; available: {', '.join(sorted(EXPORTERS))}")
    return EXPORTERS[name]


# ----------------------------------------------------------------------- FP8


def _orient(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.t().contiguous() if layout == "KN" else t.contiguous()


def _fp8_per_tensor(module: str, w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    q, s = quantize_weight_per_tensor(w)
    return {"weight": _orient(q, layout), "weight_scale": s.reshape(()).clone()}


def _fp8_block(module: str, w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    q, s = quantize_weight_blockwise(w, (128, 128))
    return {"weight": _orient(q, layout), "weight_scale_inv": _orient(s, layout)}


# MoE routers are linear layers the exporters leave dense (not ``*_proj``): say so.
_FP8_IGNORED = ["re:.*\\.mlp\\.(gate|router)$"]


def _fp8_config(layout: str) -> dict[str, Any]:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_layout": layout,
            "ignored_layers": list(_FP8_IGNORED)}


def _fp8_block_config(layout: str) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "weight_layout": layout,
            "ignored_layers": list(_FP8_IGNORED)}


register_exporter(QuantExporter(
    "fp8", _fp8_per_tensor, _fp8_config,
    description="FP8 E4M3, one scale per tensor (weight_scale), dynamic per-token activations"))
register_exporter(QuantExporter(
    "fp8-block", _fp8_block, _fp8_block_config,
    description="FP8 E4M3, 128x128 block scales (weight_scale_inv), dynamic 1x128 activations"))
