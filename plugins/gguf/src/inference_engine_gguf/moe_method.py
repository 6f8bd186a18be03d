"""MoE experts kept in their GGML blocks: the fused-MoE method of the ``gguf`` quant method.

The core's fused MoE layer asks its method for dense ``gate_up [E, 2I, K]`` and
``down [E, K_out, I]`` tensors per forward. This method stores the file's
stacked expert tensors as raw rows (``[E, 2I, row_bytes]``: gate rows then up
rows, as the layer fuses them) and dequantizes them for that forward only, so
the resident expert memory is the file's bytes. Rows are whole GGML rows, so
the core's per-expert loader (which narrows rows) fills them unchanged.
Expert biases (gpt-oss's ``ffn_{gate,up,down}_exps.bias``) are small and stay dense.

With ``activations=q8`` on CPU (the default there) the experts multiply as llama.cpp's
``mul_mat_id`` does instead: each routed expert's rows straight from its blocks, the
activations rounded as for a linear layer of that type (Q8_K / Q8_0 / Q8_1 and integer dot
products, F16 / BF16 rounding), and only the experts some token chose are touched
(:meth:`GGMLFusedMoEMethod.apply`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from inference_engine.layers.moe.activation import gated_activation
from inference_engine.layers.moe.dispatch import sort_by_expert
from inference_engine.layers.moe.method import ExpertWeights, FusedMoEMethod, load_expert_part
from torch import nn

from inference_engine_gguf import cpu_kernels, q8k_kernels
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.raw_tensors import FLOAT_DTYPES, empty_raw

T = GGMLQuantizationType

__all__ = ["GGMLFusedMoEMethod", "expert_linear"]


class GGMLFusedMoEMethod(FusedMoEMethod):
    """Experts as GGML rows: gate/up share ``gate_up_type``, down has ``down_type``."""

    def __init__(self, gate_up_type: GGMLQuantizationType, down_type: GGMLQuantizationType,
                 dequantize_at_load: bool = False, activations: str = "float") -> None:
        self.gate_up_type = gate_up_type
        self.down_type = down_type
        self.dequantize_at_load = dequantize_at_load
        self.activations = activations

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
        elif self.uses_q8(layer):
            # The core's FusedMoE multiplies the dense weights expert_weights() returns;
            # llama.cpp's arithmetic needs the blocks, so the layer runs apply() instead.
            layer.forward = partial(self.apply, layer)

    def uses_q8(self, layer: nn.Module) -> bool:
        """Whether ``layer`` multiplies as llama.cpp does: ``activations=q8``, CPU, the
        C++ kernel built."""
        return (self.activations == "q8" and layer.gate_up_proj.device.type == "cpu"
                and q8k_kernels.kernel() is not None)

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, experts_fn: Callable[..., torch.Tensor] | None = None
              ) -> torch.Tensor:
        """``x [T, hidden]``, router ``weights``/``ids [T, k]`` -> ``[T, hidden]``: each
        chosen expert's two matmuls in llama.cpp's arithmetic (see the module docstring).

        Called with the layer's ``experts_fn`` (the core ``FusedMoE.forward``, layers that do
        not multiply as llama.cpp does): the dense weights through that kernel instead.
        """
        if experts_fn is not None:
            return super().apply(layer, x, weights, ids, experts_fn)
        dispatch = sort_by_expert(ids, layer.gate_up_proj.shape[0])
        xs = x.index_select(0, dispatch.token_of).float()  # [T*k, K] in expert order
        ys = xs.new_empty(xs.shape[0], layer.down_proj.shape[1])
        gate_up_bias, down_bias = _biases(layer)
        start = 0
        for expert, count in enumerate(dispatch.counts.tolist()):
            if not count:
                continue
            rows = slice(start, start + count)
            h = expert_linear(xs[rows], layer.gate_up_proj[expert], self.gate_up_type)
            if gate_up_bias is not None:
                h = h + gate_up_bias[expert].float()
            act = gated_activation(h, layer.activation)
            y = expert_linear(act, layer.down_proj[expert], self.down_type)
            if down_bias is not None:
                y = y + down_bias[expert].float()
            ys[rows] = y
            start += count
        ys.mul_(weights.reshape(-1)[dispatch.order].float().unsqueeze(1))
        out = torch.zeros(x.shape[0], ys.shape[1], dtype=torch.float32, device=x.device)
        return out.index_add_(0, dispatch.token_of, ys).to(x.dtype)

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


def expert_linear(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType
                   ) -> torch.Tensor:
    """``x [n, K] @ W.T`` for one expert's stored rows ``raw``, float32, as llama.cpp's CPU
    backend multiplies that type (``activations=q8``)."""
    if qtype in q8k_kernels.Q8_TYPES:
        return q8k_kernels.q8_linear(x, raw, qtype)
    if qtype in (T.F16, T.BF16):  # activations rounded to the weight's type first
        x = x.to(FLOAT_DTYPES[qtype])
    return F.linear(x.float(), dequantize(raw, qtype))
