"""MXFP4 / MXFP8 block quantization: 32 consecutive elements along K share one E8M0 scale.

quant-formats.md section 6 (OCP Microscaling v1.0). For a block with largest
magnitude ``amax`` the scale is ``X = 2^e`` (:mod:`.mx_e8m0`), the elements
are ``RNE(clamp(v / X, ±max_elem))`` in E2M1 (MXFP4, packed two per byte) or
E4M3 (MXFP8), and dequantization is ``decode(q) * X``. A last dimension that
is not a multiple of 32 is zero-padded to one; the padding dequantizes to 0
and callers slice it off.

:func:`dequantize_mxfp4` is the one entry point for gpt-oss tensors
(``*_blocks`` ``[..., K/32, 16]`` with ``*_scales`` ``[..., K/32]``), shared with
the fused-MoE experts.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from inference_engine_quant.fp8_cast import E4M3FN_MAX, cast_to_fp8
from inference_engine_quant.mx_e2m1 import E2M1_MAX, decode_packed_e2m1, encode_e2m1, pack_e2m1
from inference_engine_quant.mx_e8m0 import ScaleRule, decode_e8m0, e8m0_from_amax

__all__ = [
    "MX_BLOCK_SIZE",
    "MxElement",
    "dequantize_mx",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "pad_to_block",
    "quantize_mx",
    "quantize_mxfp4",
    "quantize_mxfp8",
]

MX_BLOCK_SIZE = 32

MxElement = Literal["e2m1", "e4m3"]

# element -> (emax, max finite value)
_ELEMENTS: dict[str, tuple[int, float]] = {"e2m1": (2, E2M1_MAX), "e4m3": (8, E4M3FN_MAX)}


def pad_to_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad the last dimension of ``x`` up to a multiple of ``block``."""
    extra = (-x.shape[-1]) % block
    return F.pad(x, (0, extra)) if extra else x


def quantize_mx(
    x: torch.Tensor, element: MxElement, rule: ScaleRule = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to MX blocks of 32 along the last dimension.

    Args:
        x: values (any float dtype; computed in float32).
        element: ``"e2m1"`` (MXFP4) or ``"e4m3"`` (MXFP8).
        rule: E8M0 exponent rule, ``"floor"`` (OCP) or ``"rceil"``.

    Returns:
        ``(values, scales)``: for e2m1 ``values`` is packed uint8 ``[..., Kp/2]``,
        for e4m3 ``float8_e4m3fn [..., Kp]``; ``scales`` is uint8 ``[..., Kp/32]``
        (``Kp`` = K rounded up to 32).

    Raises:
        ValueError: for an unknown element type.
    """
    if element not in _ELEMENTS:
        raise ValueError(f"unknown MX element type {element!r}; expected 'e2m1' or 'e4m3'")
    emax, max_elem = _ELEMENTS[element]
    x = pad_to_block(x.float(), MX_BLOCK_SIZE)
    blocks = x.unflatten(-1, (-1, MX_BLOCK_SIZE))  # [..., Kp/32, 32]
    # NaN must survive the amax (torch.amax propagates NaN).
    amax = blocks.abs().amax(dim=-1)
    scales = e8m0_from_amax(amax, emax, max_elem, rule)
    scale_values = decode_e8m0(scales).unsqueeze(-1)
    scaled = torch.nan_to_num(blocks / scale_values, nan=0.0)
    scaled = scaled.clamp(-max_elem, max_elem).flatten(-2)
    if element == "e2m1":
        return pack_e2m1(encode_e2m1(scaled)), scales
    return cast_to_fp8(scaled, torch.float8_e4m3fn), scales


def dequantize_mx(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``decode(values) * 2^(scale - 127)`` per 32 elements; returns ``[..., Kp]`` in ``dtype``.

    ``values`` is packed uint8 E2M1 ``[..., Kp/2]`` or ``float8_e4m3fn [..., Kp]``.

    Raises:
        ValueError: when the number of scales does not match the values.
    """
    if values.dtype == torch.uint8:
        decoded = decode_packed_e2m1(values, torch.float32)
    elif values.dtype == torch.float8_e4m3fn:
        decoded = values.float()
    else:
        raise ValueError(
            f"MX values must be packed uint8 (E2M1) or float8_e4m3fn, got {values.dtype}"
        )
    k = decoded.shape[-1]
    if k != scales.shape[-1] * MX_BLOCK_SIZE or decoded.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"MX scales of shape {tuple(scales.shape)} do not match {k} elements per row of "
            f"shape {tuple(decoded.shape[:-1])} (one scale per {MX_BLOCK_SIZE})"
        )
    out = decoded.unflatten(-1, (-1, MX_BLOCK_SIZE)) * decode_e8m0(scales).unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(x: torch.Tensor, rule: ScaleRule = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``x [..., K]``: packed uint8 ``[..., Kp/2]`` and E8M0 bytes ``[..., Kp/32]``."""
    return quantize_mx(x, "e2m1", rule)


def quantize_mxfp8(x: torch.Tensor, rule: ScaleRule = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``x [..., K]``: ``float8_e4m3fn [..., Kp]`` and E8M0 bytes ``[..., Kp/32]``."""
    return quantize_mx(x, "e4m3", rule)


def dequantize_mxfp8(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``float(values) * 2^(scale - 127)`` per 32 elements along the last dimension."""
    return dequantize_mx(values, scales, dtype)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dense weights from gpt-oss-style MXFP4 tensors.

    Accepts the checkpoint layout ``blocks [..., K/32, 16]`` (uint8, two E2M1
    codes per byte, low nibble first) with ``scales [..., K/32]`` (E8M0 bytes),
    e.g. ``gate_up_proj_blocks [E, 2I, H/32, 16]``, or the flat
    ``blocks [..., K/2]``. The fused-MoE layer calls this for gpt-oss experts.

    Returns:
        ``[..., K]`` in ``dtype``, same leading dimensions as ``scales``.

    Raises:
        ValueError: for a dtype other than uint8 or shapes that do not match.
    """
    if blocks.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks must be uint8 (two FP4 codes per byte), got {blocks.dtype}")
    if blocks.dim() == scales.dim() + 1:
        if blocks.shape[-1] != MX_BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
            raise ValueError(
                f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: "
                f"expected blocks [..., K/32, 16] with scales [..., K/32]"
            )
        blocks = blocks.flatten(-2)
    return dequantize_mx(blocks, scales, dtype)
