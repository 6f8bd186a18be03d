"""MoE experts kept in their GGML blocks: the fused-MoE method of the ``gguf`` quant method.

The core's fused MoE layer asks its method for dense ``gate_up [E, 2I, K]`` and
``down [E, K_out, I]`` tensors per forward. This method stores the file's
stacked expert tensors as raw rows (``[E, 2I, row_bytes]``: gate rows then up
rows, as the layer fuses them) and dequantizes them for that forward only, so
the resident expert memory is the file's bytes. Rows are whole GGML rows, so
the core's per-expert loader (which narrows rows) fills them unchanged.
Expert biases (gpt-oss's ``ffn_{gate,up,down}_exps.bias``) are small and stay dense.
"""

from __future__ import annotations

from functools import partial

import torch
from gguf.constants import GGMLQuantizationType
from inference_engine.layers.moe.method import ExpertWeights, FusedMoEMethod, load_expert_part
from torch import nn

from inference_engine_gguf import cpu_kernels
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.raw_tensors import empty_raw

__all__ = ["GGMLFusedMoEMethod"]


class GGMLFusedMoEMethod(FusedMoEMethod):
    """Experts as GGML rows: gate/up share ``gate_up_type``, down has ``down_type``."""

    def __init__(self, gate_up_type: GGMLQuantizationType, down_type: GGMLQuantizationType,
                 dequantize_at_load: bool = False) -> None:
        self.gate_up_type = gate_up_type
        self.down_type = down_type
        self.dequantize_at_load = dequantize_at_load

    def create_weights(self, layer: nn.Module, prefix: str, num_experts: int, hidden_size: int,
                       intermediate_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        layer.gguf_dtype = params_dtype  # type: ignore[attr-defined]
        shapes = {"gate_up_proj": (self.gate_up_type, 2 * intermediate_size, hidden_size),
                  "down_proj": (self.down_type, hidden_size, intermediate_size)}
        tensors = {name: empty_raw(qtype, (num_experts * rows, k)).reshape(num_experts, rows, -1)
                   for name, (qtype, rows, k) in shapes.items()}
        if bias:  # dense [E, 2I] and [E, K_out], in the compute dtype
            tensors["gate_up_proj_bias"] = torch.empty(num_experts, 2 * intermediate_size,
                                                       dtype=params_dtype)
            tensors["down_proj_bias"] = torch.empty(num_experts, hidden_size, dtype=params_dtype)
        for name, tensor in tensors.items():
            param = nn.Parameter(tensor, requires_grad=False)
            param.weight_loader = partial(  # type: ignore[attr-defined]
                load_expert_part, intermediate_size, name=f"{prefix}.{name}")
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.dequantize_at_load:
            gate_up, down, _, _ = self._dense(layer)
            layer.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
            layer.down_proj = nn.Parameter(down, requires_grad=False)
            self.gate_up_type = self.down_type = None  # type: ignore[assignment]

    def expert_weights(self, layer: nn.Module) -> ExpertWeights:
        if self.gate_up_type is None:  # dequantized at load
            return layer.gate_up_proj, layer.down_proj, *_biases(layer)
        return self._dense(layer)

    def _dense(self, layer: nn.Module) -> ExpertWeights:
        dtype = layer.gguf_dtype
        gate_up = _dequantize(layer.gate_up_proj, self.gate_up_type).to(dtype)
        down = _dequantize(layer.down_proj, self.down_type).to(dtype)
        return gate_up, down, *_biases(layer)


def _biases(layer: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return getattr(layer, "gate_up_proj_bias", None), getattr(layer, "down_proj_bias", None)


def _dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The C++ dequantization (bit-exact, several times faster) where built, else torch."""
    if (qtype in cpu_kernels.KERNEL_TYPES and raw.device.type == "cpu"
            and cpu_kernels.kernel() is not None):
        return cpu_kernels.dequantize(raw, qtype)
    return dequantize(raw, qtype)
