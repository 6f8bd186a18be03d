"""INT8 W8A8: int8 weights with a scale per output channel, activations quantized per token.

compressed-tensors' ``W8A8`` preset (``int-quantized`` format): ``weight [N, K]``
int8 (symmetric), ``weight_scale [N, 1]`` (or ``[1]`` per tensor); activations
dynamic, symmetric, one scale per token. Per call, as the compressed-tensors
library computes symmetric int8 parameters (``calculate_qparams``: the scale
is ``amax`` over half the range ``255 / 2``):
``s_x[t] = amax(|x[t, :]|) / 127.5``, ``q_x = clamp(round(x / s_x), -128, 127)``
(vLLM's ``scaled_int8_quant`` divides by 127 instead: a last-bit difference), and

``y[t, n] = (Σ_k q_x[t, k] · q_w[k, n]) · s_x[t] · s_w[n]``.

Kernel choice (once, at layer build): ``torch._int_mm`` (exact int32
accumulation) where ``platform.int_gemm_kernels()`` lists it (the CPU's oneDNN
int8 GEMM, CUDA sm80+), else the dequantized reference: the activation
quantize-dequantized and the weight dequantized, multiplied in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from inference_engine.interfaces.platform import KERNEL_INT8_MM
from torch import nn

from inference_engine_quant.mx_linear import replace_params

__all__ = [
    "INT8_KERNEL_NAMES",
    "apply_int8_w8a8",
    "choose_int8_kernel",
    "finalize_int8_w8a8",
    "quantize_activation_per_token",
]

INT8_KERNEL_NAMES = {
    "int_mm": "torch._int_mm (int8 x int8, per-token activations)",
    "reference": "torch dequantize + matmul (reference)",
}

# Symmetric int8 scale divisor of compressed-tensors: (127 - (-128)) / 2.
_HALF_RANGE = 127.5

# torch._int_mm wants more than 16 rows on CUDA; fewer are padded with zero rows.
_INT_MM_MIN_ROWS = 17


def choose_int8_kernel(platform: Any) -> str:
    """``"int_mm"`` where the platform lists ``torch._int_mm``, else ``"reference"``."""
    listed = getattr(platform, "int_gemm_kernels", None) if platform is not None else None
    if listed is not None and KERNEL_INT8_MM in listed() and hasattr(torch, "_int_mm"):
        return "int_mm"
    return "reference"


def quantize_activation_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_x int8 [T, K], s_x float32 [T, 1])`` with ``s_x = amax / 127.5`` per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _HALF_RANGE).clamp(min=1e-10)
    q = torch.round(xf / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def finalize_int8_w8a8(layer: nn.Module, weight_nk: torch.Tensor, scale_n: torch.Tensor,
                       platform: Any, remove: tuple[str, ...]) -> None:
    """Keep ``weight [K, N]`` int8 (column-major), ``weight_scale [N]`` float32; pick the kernel."""
    if weight_nk.dtype != torch.int8:
        raise ValueError(f"{getattr(layer, 'prefix', '?')}: INT8 W8A8 weights must be int8, "
                         f"got {weight_nk.dtype}")
    replace_params(layer, remove, weight=weight_nk.contiguous().t(),
                   weight_scale=scale_n.float().reshape(-1).contiguous())
    layer.int8_kernel = choose_int8_kernel(platform)


def apply_int8_w8a8(layer: nn.Module, x: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, K] @ W (+ bias)`` with per-token int8 activations, in ``x.dtype``."""
    q_x, s_x = quantize_activation_per_token(x)
    weight = layer.weight
    if layer.int8_kernel == "int_mm":
        rows = q_x.shape[0]
        if rows < _INT_MM_MIN_ROWS:
            q_x = F.pad(q_x, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
        acc = torch._int_mm(q_x, weight)[:rows].float()
    else:
        acc = q_x.float() @ weight.float()
    y = acc * s_x * layer.weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
