"""MXFP4 experts of a fused-MoE layer (``*_blocks`` / ``*_scales`` checkpoints, or online).

Checkpoints stack each MoE layer's experts (quant-formats.md section 8):
``gate_up_proj_blocks`` U8 ``[E, 2I, H/32, 16]`` with ``gate_up_proj_scales``
U8 ``[E, 2I, H/32]``, ``down_proj_blocks`` ``[E, H, I/32, 16]`` with
``down_proj_scales``, and (gpt-oss) bf16 biases. The engine's layout is gate
rows then up rows (MiniMax-M3 writes it so); a model whose checkpoint
interleaves them (gpt-oss: gate, up, gate, up, ...) de-interleaves the packed
rows in its ``checkpoint_transform`` (rows are independent), so the weights
stay packed in memory.
Each forward runs :func:`~inference_engine_quant.quant_moe.fused_moe_quant`
with the layer's build-time kernel: the Triton grouped GEMM decodes the packed
tiles in registers; the torch path (CPU) dequantizes only the experts that
received tokens. ``dequantize_at_load`` keeps a dense copy instead.
Online (``--quantization mxfp4`` on a bf16 MoE checkpoint) the dense experts
are quantized after loading with the same OCP rule as linear layers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from inference_engine.layers.moe.method import (
    ExpertWeights,
    FusedMoEMethod,
    UnquantizedFusedMoEMethod,
    load_expert_part,
)
from torch import nn

from inference_engine_quant.mx_block import MX_BLOCK_SIZE, dequantize_mxfp4, quantize_mxfp4
from inference_engine_quant.mx_e8m0 import ScaleRule
from inference_engine_quant.mx_linear import replace_params
from inference_engine_quant.quant_moe import QuantExperts, fused_moe_quant

__all__ = ["Mxfp4FusedMoEMethod"]

_HALF = MX_BLOCK_SIZE // 2


class Mxfp4FusedMoEMethod(FusedMoEMethod):
    """MXFP4 experts (gpt-oss, MiniMax-M3 or online-quantized ones), packed at rest."""

    # Blocks, scales and biases run over experts first: whole experts are placed over EP
    # ranks.
    supports_expert_parallel = True

    def tensor_parallel_block(self) -> int | None:
        """down's 32-value blocks run along the intermediate width (gate/up's along the
        hidden one, by rows): a TP slice keeps them whole (online too: the same blocks)."""
        return MX_BLOCK_SIZE

    # Name under which weight-memory reports list these experts.
    format_name = "mxfp4"

    def __init__(self, online: bool, dequantize_at_load: bool = False,
                 rule: ScaleRule = "floor") -> None:
        self.online = online
        self.dequantize_at_load = dequantize_at_load
        self.rule = rule
        self._dense = UnquantizedFusedMoEMethod()

    def create_weights(self, layer: nn.Module, prefix: str, num_experts: int, hidden_size: int,
                       intermediate_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        layer.mx_params_dtype = params_dtype
        layer.mx_k = {"gate_up": hidden_size, "down": intermediate_size}
        if self.online:
            self._dense.create_weights(layer, prefix, num_experts, hidden_size, intermediate_size,
                                       params_dtype, bias)
            return
        hb, ib = -(-hidden_size // MX_BLOCK_SIZE), -(-intermediate_size // MX_BLOCK_SIZE)
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "gate_up_proj_blocks": ((num_experts, 2 * intermediate_size, hb, _HALF), torch.uint8),
            "gate_up_proj_scales": ((num_experts, 2 * intermediate_size, hb), torch.uint8),
            "down_proj_blocks": ((num_experts, hidden_size, ib, _HALF), torch.uint8),
            "down_proj_scales": ((num_experts, hidden_size, ib), torch.uint8),
        }
        if bias:
            shapes["gate_up_proj_bias"] = ((num_experts, 2 * intermediate_size), params_dtype)
            shapes["down_proj_bias"] = ((num_experts, hidden_size), params_dtype)
        for name, (shape, dtype) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = partial(  # type: ignore[attr-defined]
                load_expert_part, intermediate_size, name=f"{prefix}.{name}")
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            tensors = {}
            for part in ("gate_up", "down"):
                packed, scales = quantize_mxfp4(getattr(layer, f"{part}_proj").data, self.rule)
                tensors[f"{part}_proj_blocks"] = packed.unflatten(-1, (-1, _HALF))
                tensors[f"{part}_proj_scales"] = scales
        else:
            tensors = {  # already gate-then-up (the model's checkpoint_transform)
                "gate_up_proj_blocks": layer.gate_up_proj_blocks.data,
                "gate_up_proj_scales": layer.gate_up_proj_scales.data,
                "down_proj_blocks": layer.down_proj_blocks.data,
                "down_proj_scales": layer.down_proj_scales.data,
            }
        remove = ("gate_up_proj", "down_proj") + tuple(tensors)
        if self.dequantize_at_load:
            dense = {f"{part}_proj": self._dequantize(layer, part, tensors)
                     for part in ("gate_up", "down")}
            replace_params(layer, remove, **dense)
            layer.mx_dense = True
            return
        replace_params(layer, remove, **{k: v.contiguous() for k, v in tensors.items()})
        layer.mx_dense = False

    @staticmethod
    def _dequantize(layer: nn.Module, part: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        dense = dequantize_mxfp4(tensors[f"{part}_proj_blocks"], tensors[f"{part}_proj_scales"],
                                 layer.mx_params_dtype)
        return dense[..., : layer.mx_k[part]].contiguous()

    def expert_weights(self, layer: nn.Module) -> ExpertWeights:
        bias = (getattr(layer, "gate_up_proj_bias", None), getattr(layer, "down_proj_bias", None))
        if layer.mx_dense:
            return (layer.gate_up_proj, layer.down_proj, *bias)
        # Whole-layer dequantization: for callers that want dense weights; forward does not.
        tensors = dict(layer.named_parameters(recurse=False))
        return (self._dequantize(layer, "gate_up", tensors),
                self._dequantize(layer, "down", tensors), *bias)

    def quant_experts(self, layer: nn.Module) -> QuantExperts:
        """The packed experts as the quantized grouped GEMM reads them (views, no copy)."""
        return QuantExperts(
            "mxfp4", layer.gate_up_proj_blocks.flatten(-2), layer.gate_up_proj_scales,
            layer.down_proj_blocks.flatten(-2), layer.down_proj_scales,
            layer.mx_k["gate_up"], layer.mx_k["down"], (1, MX_BLOCK_SIZE),
            getattr(layer, "gate_up_proj_bias", None), getattr(layer, "down_proj_bias", None))

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              experts_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Packed experts through the quantized grouped GEMM (dense ones through the layer's)."""
        if layer.mx_dense:
            return super().apply(layer, x, weights, ids, experts_fn)
        return fused_moe_quant(layer.kernel, x, self.quant_experts(layer), weights, ids,
                               layer.activation)

    def weight_memory_bytes(self, layer: nn.Module) -> int:
        """Bytes of the experts' weights and scales at rest (biases excluded)."""
        return sum(p.numel() * p.element_size() for name, p in layer.named_parameters(recurse=False)
                   if not name.endswith("_bias"))
