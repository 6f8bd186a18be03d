"""``inference-engine quantize --method mxfp4|mxfp8|nvfp4``: the checkpoints these methods write.

Each exporter turns one decoder linear weight ``[N, K]`` into the tensors of a
real checkpoint of that format (quant-formats.md section 8); FP4/MX tensors
are blocked along K, so they keep the row-major ``[N, ...]`` layout every
producer uses (the FP8 (K, N) rule of the engine concerns plain FP8 weights):

* ``mxfp4`` (gpt-oss style, ``quant_method: "mxfp4"``): ``weight_blocks`` U8
  ``[N, K/32, 16]`` and ``weight_scales`` U8 ``[N, K/32]`` (OCP floor rule);
  ``modules_to_not_convert`` lists the embeddings and LM head.
* ``mxfp8`` (ModelOpt ``quant_algo: "MXFP8"``): ``weight`` F8_E4M3 ``[N, K]``,
  ``weight_scale`` U8 ``[N, K/32]``.
* ``nvfp4`` (ModelOpt ``quant_algo: "NVFP4"``): ``weight`` U8 ``[N, K/2]``,
  ``weight_scale`` F8_E4M3 ``[N, K/16]``, ``weight_scale_2`` F32 scalar. No
  calibration runs, so there is no ``input_scale``: the checkpoint is
  weight-only (W4A16), which the engine's loader honours.

The ModelOpt exporters also write ``hf_quant_config.json``, as ModelOpt does.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from inference_engine_quant.mx_block import MX_BLOCK_SIZE, quantize_mxfp4, quantize_mxfp8
from inference_engine_quant.nvfp4_codec import NVFP4_BLOCK_SIZE, quantize_nvfp4
from inference_engine_quant.quantize_exporters import QuantExporter, register_exporter

__all__ = ["MXFP4_EXPORTER", "MXFP8_EXPORTER", "NVFP4_EXPORTER"]

_PRODUCER = {"name": "inference-engine", "version": "0.1.0"}
_NOT_CONVERTED = ["model.embed_tokens", "lm_head"]


def _mxfp4_tensors(module: str, w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    packed, scales = quantize_mxfp4(w)
    return {"weight_blocks": packed.unflatten(-1, (-1, MX_BLOCK_SIZE // 2)).contiguous(),
            "weight_scales": scales}


def _mxfp4_config(layout: str) -> dict[str, Any]:
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(_NOT_CONVERTED)}


def _mxfp8_tensors(module: str, w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    values, scales = quantize_mxfp8(w)
    return {"weight": values[:, : w.shape[1]].contiguous(), "weight_scale": scales}


def _nvfp4_tensors(module: str, w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    if w.shape[1] % NVFP4_BLOCK_SIZE:
        raise ValueError(f"{module}.weight: NVFP4 needs K divisible by {NVFP4_BLOCK_SIZE}, "
                         f"got shape {tuple(w.shape)}")
    packed, block_scales, global_scale = quantize_nvfp4(w)
    return {"weight": packed, "weight_scale": block_scales,
            "weight_scale_2": global_scale.reshape(()).clone()}


def _modelopt_section(algo: str) -> dict[str, Any]:
    section: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None,
                               "exclude_modules": ["lm_head"]}
    if algo == "NVFP4":
        section["group_size"] = NVFP4_BLOCK_SIZE
    return section


def _modelopt_config(algo: str) -> Any:
    def config(layout: str) -> dict[str, Any]:
        return {"quant_method": "modelopt", "producer": dict(_PRODUCER), **_modelopt_section(algo),
                "ignore": ["lm_head"]}
    return config


def _modelopt_files(algo: str) -> Any:
    def files(layout: str) -> dict[str, str]:
        body = {"producer": dict(_PRODUCER), "quantization": _modelopt_section(algo)}
        return {"hf_quant_config.json": json.dumps(body, indent=2) + "\n"}
    return files


MXFP4_EXPORTER = QuantExporter(
    "mxfp4", _mxfp4_tensors, _mxfp4_config, layouts=("NK",),
    description="MXFP4 (E2M1 + E8M0 per 32), gpt-oss-style weight_blocks/weight_scales")
MXFP8_EXPORTER = QuantExporter(
    "mxfp8", _mxfp8_tensors, _modelopt_config("MXFP8"), layouts=("NK",),
    description="MXFP8 (E4M3 + E8M0 per 32), ModelOpt MXFP8 weight/weight_scale",
    extra_files=_modelopt_files("MXFP8"))
NVFP4_EXPORTER = QuantExporter(
    "nvfp4", _nvfp4_tensors, _modelopt_config("NVFP4"), layouts=("NK",),
    description="NVFP4 (E2M1 + E4M3 per 16 + FP32 global), ModelOpt, weight-only (no input_scale)",
    extra_files=_modelopt_files("NVFP4"))

for _exporter in (MXFP4_EXPORTER, MXFP8_EXPORTER, NVFP4_EXPORTER):
    register_exporter(_exporter)
