"""NVFP4: E2M1 elements, an FP8 E4M3 scale per 16 elements, an FP32 global scale.

quant-formats.md section 7 (ModelOpt's two-level scheme, which torchao matches):

* global ``g = amax(|W|) / (6 * 448)`` (fp32, ModelOpt's ``weight_scale_2``);
* per 16-block ``b = e4m3(amax_block / (6 * g))`` (``weight_scale``); as in
  ModelOpt a zero block gets ``b = 1``;
* elements ``q = RNE_e2m1(clamp(W / (f32(b) * g), ±6))``, packed two per byte;
* dequant ``W ≈ decode(q) * f32(b) * g``.

Activations (W4A4) use a calibrated static ``input_scale = amax_x / (6*448)``
in the global role; each 16-block of a row gets ``e4m3(amax_blk / (6 * input_scale))``.
A block scale that underflows to 0 in E4M3 quantizes its elements to 0.
"""

from __future__ import annotations

import torch

from inference_engine_quant.fp8_cast import E4M3FN_MAX, cast_to_fp8, scale_from_amax
from inference_engine_quant.mx_block import pad_to_block
from inference_engine_quant.mx_e2m1 import E2M1_MAX, decode_packed_e2m1, encode_e2m1, pack_e2m1

__all__ = [
    "NVFP4_BLOCK_SIZE",
    "dequantize_nvfp4",
    "nvfp4_global_scale",
    "quantize_nvfp4",
    "quantize_nvfp4_with_global",
    "qdq_nvfp4_activation",
]

NVFP4_BLOCK_SIZE = 16


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """``amax(|x|) / (6 * 448)`` as a float32 scalar (1.0 for an all-zero tensor)."""
    return scale_from_amax(x.float().abs().amax(), E2M1_MAX * E4M3FN_MAX)


def quantize_nvfp4_with_global(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of ``x [..., K]`` under a given global scale (broadcast against the rows).

    Returns:
        ``(packed uint8 [..., Kp/2], block scales float8_e4m3fn [..., Kp/16])``,
        ``Kp`` = K rounded up to 16 (zero padding).
    """
    g = global_scale.float()
    x = pad_to_block(x.float(), NVFP4_BLOCK_SIZE)
    blocks = x.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., Kp/16, 16]
    g_blocks = g.reshape(*g.shape, 1) if g.dim() else g  # per-row globals broadcast per block
    amax = blocks.abs().amax(dim=-1)
    raw = amax / (E2M1_MAX * g_blocks)
    raw = torch.where(raw == 0, torch.ones_like(raw), raw)  # ModelOpt: zero blocks get 1
    block_scales = cast_to_fp8(raw, torch.float8_e4m3fn)
    denom = (block_scales.float() * g_blocks).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0),
                         torch.zeros_like(blocks))
    scaled = torch.nan_to_num(scaled, nan=0.0).clamp(-E2M1_MAX, E2M1_MAX).flatten(-2)
    return pack_e2m1(encode_e2m1(scaled)), block_scales


def quantize_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of a weight ``x [N, K]`` with its own global scale.

    Returns:
        ``(packed uint8 [N, Kp/2], weight_scale float8_e4m3fn [N, Kp/16],
        weight_scale_2 float32 scalar)`` as ModelOpt stores them.
    """
    g = nvfp4_global_scale(x)
    packed, block_scales = quantize_nvfp4_with_global(x, g)
    return packed, block_scales, g


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``decode(q) * f32(b) * g``; ``global_scale`` is a scalar or one value per row.

    Raises:
        ValueError: when the block scales do not cover the packed values.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 values must be packed uint8, got {packed.dtype}")
    values = decode_packed_e2m1(packed, torch.float32)
    k = values.shape[-1]
    rows_match = values.shape[:-1] == block_scales.shape[:-1]
    if k != block_scales.shape[-1] * NVFP4_BLOCK_SIZE or not rows_match:
        raise ValueError(
            f"NVFP4 block scales of shape {tuple(block_scales.shape)} do not match {k} elements "
            f"per row of shape {tuple(values.shape[:-1])} (one scale per {NVFP4_BLOCK_SIZE})"
        )
    g = global_scale.float()
    scale = block_scales.float() * (g.unsqueeze(-1) if g.dim() else g)
    out = values.unflatten(-1, (-1, NVFP4_BLOCK_SIZE)) * scale.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def qdq_nvfp4_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Quantize then dequantize activations ``x [T, K]`` to NVFP4 with a static ``input_scale``.

    Emulates the W4A4 GEMM's activation side on hardware without FP4 math:
    ``y = alpha * Σ (q_x b_x)(q_w b_w)`` equals a matmul of the two dequantized
    operands. Returns ``[T, K]`` in ``x.dtype``.
    """
    k = x.shape[-1]
    packed, block_scales = quantize_nvfp4_with_global(x, input_scale)
    return dequantize_nvfp4(packed, block_scales, input_scale, x.dtype)[..., :k]
