"""FP8 quantizers and the plain-PyTorch FP8 GEMM: the ground truth for every FP8 kernel.

Formulas are quant-formats.md sections 3-5, all scales dequant multipliers:

* per-tensor weight: ``s = amax(|W|) / 448``;
* per-channel weight (PTPC): ``s[n] = amax(|W[n, :]|) / 448``;
* 128x128 block weight: ``S[i, j] = amax(W[128i:.., 128j:..]) / 448`` (edge tiles partial);
* dynamic activations: ``s_x[t] = amax(|x[t, :]|) / 448`` per token, or per token
  and 128-column group for block checkpoints.

Checkpoint-side helpers take weights ``[N, K]`` (the HF/vLLM convention).
The engine's runtime form is (K, N): ``weight_kn [K, N]`` with a scale grid
``scale_kn [ceil(K / bk), ceil(N / bn)]`` for blocks of ``bk`` rows of K by
``bn`` columns of N (per-channel is ``bk = K, bn = 1``). Activation groups
always coincide with the weight's K blocks, so one GEMM shape covers all
FP8 schemes: ``y = sum_g s_x[:, g] * (q_x[:, g] @ (q_w[g, :] * s_w[g, :]))``.
"""

from __future__ import annotations

import math

import torch

from inference_engine_quant.fp8_cast import (
    fp8_max,
    quantize_fp8,
    scale_from_amax,
)

__all__ = [
    "dequantize_weight_kn",
    "expand_scale_grid",
    "qdq_activation",
    "quantize_activation",
    "quantize_weight_blockwise",
    "quantize_weight_per_channel",
    "quantize_weight_per_tensor",
    "reference_fp8_linear",
]


def quantize_weight_per_tensor(
    w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` with a 0-d float32 ``s = amax(|W|) / fp8max``."""
    s = scale_from_amax(w.abs().amax(), fp8_max(dtype))
    return quantize_fp8(w, s, dtype), s


def quantize_weight_per_channel(
    w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, max_value: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K], s [N, 1])``: one scale per output row (PTPC / FP8_DYNAMIC)."""
    limit = fp8_max(dtype) if max_value is None else max_value
    s = scale_from_amax(w.abs().amax(dim=1, keepdim=True), limit)
    return quantize_fp8(w, s, dtype, limit), s


def quantize_weight_blockwise(
    w: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K], S [ceil(N/bn), ceil(K/bk)])``, ``block = (bn, bk)`` as ``weight_block_size``.

    Edge tiles are partial: their amax is taken over the elements that exist.
    """
    n, k = w.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float().abs()
    amax = padded.view(gn, bn, gk, bk).amax(dim=(1, 3))
    s = scale_from_amax(amax, fp8_max(dtype))
    full = expand_scale_grid(s, (bn, bk), (n, k))
    return quantize_fp8(w, full, dtype), s


def expand_scale_grid(
    scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]
) -> torch.Tensor:
    """Repeat a grid of per-block scales to one scale per element of a ``shape`` matrix.

    ``block`` is (rows, columns) of one block in the same orientation as ``scale``.
    """
    rows, cols = shape
    br, bc = block
    full = scale.float()
    if full.dim() == 0:
        return full.expand(rows, cols)
    full = full.repeat_interleave(br, dim=0)[:rows] if br != 1 else full
    full = full.repeat_interleave(bc, dim=1)[:, :cols] if bc != 1 else full
    return full.expand(rows, cols)


def quantize_activation(
    x: torch.Tensor,
    group_size: int | None,
    dtype: torch.dtype = torch.float8_e4m3fn,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_x [T, K], s_x [T, ceil(K/group)])``: dynamic per token-group, or a static scale.

    ``group_size`` None or ``>= K`` means one scale per token. Dynamic scales
    use :func:`fp8_max` with ``dynamic=True`` (224 on fnuz, 448 on fn); a
    static ``input_scale`` clamps at the format maximum.
    """
    t, k = x.shape
    if static_scale is not None:
        s = static_scale.float().reshape(1, 1).expand(t, 1)
        return quantize_fp8(x, s, dtype), s
    limit = fp8_max(dtype, dynamic=True)
    if group_size is None or group_size >= k:
        s = scale_from_amax(x.abs().amax(dim=1, keepdim=True), limit)
        return quantize_fp8(x, s, dtype, limit), s
    groups = math.ceil(k / group_size)
    padded = torch.zeros(t, groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float().abs()
    s = scale_from_amax(padded.view(t, groups, group_size).amax(dim=2), limit)
    full = expand_scale_grid(s, (1, group_size), (t, k))
    return quantize_fp8(x, full, dtype, limit), s


def qdq_activation(
    x: torch.Tensor,
    group_size: int | None,
    dtype: torch.dtype = torch.float8_e4m3fn,
    static_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize then dequantize ``x`` (float32): what an FP8 GEMM sees of the activation."""
    q, s = quantize_activation(x, group_size, dtype, static_scale)
    group = x.shape[1] if (group_size is None or static_scale is not None) else group_size
    return q.float() * expand_scale_grid(s, (1, group), tuple(x.shape))


def dequantize_weight_kn(
    weight_kn: torch.Tensor, scale_kn: torch.Tensor, block_kn: tuple[int, int],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``float(q[K, N]) * S`` for a scale grid ``S [ceil(K/bk), ceil(N/bn)]``."""
    full = expand_scale_grid(scale_kn, block_kn, tuple(weight_kn.shape))
    return (weight_kn.float() * full).to(out_dtype)


def reference_fp8_linear(
    x: torch.Tensor,
    weight_kn: torch.Tensor,
    scale_kn: torch.Tensor,
    block_kn: tuple[int, int],
    act_group: int | None,
    act_quant: bool = True,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 GEMM in float32: QDQ the activation, dequantize the weight, matmul.

    Products of FP8 values are exact in float32, so this equals the per-block
    scaled GEMM up to the order of the sums. Returns float32 ``[T, N]``.
    """
    xf = x.float()
    if act_quant:
        xf = qdq_activation(xf, act_group, weight_kn.dtype, input_scale)
    y = xf @ dequantize_weight_kn(weight_kn, scale_kn, block_kn)
    if bias is not None:
        y = y + bias.float()
    return y

