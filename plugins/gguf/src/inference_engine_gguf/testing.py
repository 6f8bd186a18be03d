"""Test and benchmark helpers: random GGML rows and ggml's Q8_K rounding in plain numpy."""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["F16_FIELDS", "q80_matmul_reference", "q8k_matmul_reference", "quantize_q8_0_numpy",
           "quantize_q8_k_numpy", "random_ggml_rows"]

T = GGMLQuantizationType

# Byte ranges of each block type that hold float16 scales (kept finite in random rows).
F16_FIELDS: dict[GGMLQuantizationType, list[tuple[int, int]]] = {
    T.Q4_0: [(0, 2)], T.Q4_1: [(0, 4)], T.Q5_0: [(0, 2)], T.Q5_1: [(0, 4)], T.Q8_0: [(0, 2)],
    T.Q2_K: [(80, 84)], T.Q3_K: [(108, 110)], T.Q4_K: [(0, 4)], T.Q5_K: [(0, 4)],
    T.Q6_K: [(208, 210)],
}
if hasattr(T, "MXFP4"):
    F16_FIELDS[T.MXFP4] = []  # the e8m0 exponent byte is valid for every value


def random_ggml_rows(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int,
                     seed: int) -> np.ndarray:
    """``uint8 [rows, row_bytes]``: random bytes with finite random float16 scales."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, type_size), dtype=np.uint8)
    for start, end in F16_FIELDS[qtype]:
        n = (end - start) // 2
        scales = (rng.standard_normal((rows, blocks_per_row, n)) * 1e-2).astype(np.float16)
        raw[..., start:end] = scales.view(np.uint8)
    return raw.reshape(rows, blocks_per_row * type_size)


def quantize_q8_k_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q8_K_ref`` on each row of ``x [M, K]``, written as its C reads:
    the first value of largest magnitude ``max``, ``iscale = -127/max``, quants
    ``min(127, nearest_int(iscale * x))`` with ggml's mantissa trick, ``d = 1/iscale``.

    Returns:
        ``(qs int8 [M, K], d float32 [M, K/256])``.
    """
    m, k = x.shape
    qs = np.zeros((m, k), np.int8)
    d = np.zeros((m, k // 256), np.float32)
    for r in range(m):
        for b in range(k // 256):
            block = x[r, 256 * b : 256 * (b + 1)].astype(np.float32)
            peak = block[int(np.argmax(np.abs(block)))]  # argmax: the first of the largest
            if peak == 0:
                continue
            iscale = np.float32(-127.0) / peak
            shifted = (iscale * block).astype(np.float32) + np.float32(12582912.0)
            v = (shifted.view(np.int32) & 0x007FFFFF) - 0x00400000
            qs[r, 256 * b : 256 * (b + 1)] = np.minimum(127, v)
            d[r, b] = np.float32(1.0) / iscale
    return qs, d


def q8k_matmul_reference(x: torch.Tensor, raw: torch.Tensor,
                         qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's K-quant matmul, stated plainly: ``x [M, K]`` rounded by
    :func:`quantize_q8_k_numpy`, times the ``gguf`` package's dequantization of ``raw``,
    in float64 (what the integer dot products sum exactly).

    Returns:
        ``(result [M, N], |activations| @ |weights|.T)``: the second scales error bounds.
    """
    qs, d = quantize_q8_k_numpy(x.detach().float().numpy())
    acts = qs.astype(np.float64) * np.repeat(d.astype(np.float64), 256, axis=1)
    w = quants.dequantize(raw.numpy(), qtype).astype(np.float64)
    return torch.from_numpy(acts @ w.T), torch.from_numpy(np.abs(acts) @ np.abs(w).T)


def quantize_q8_0_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's x86 ``quantize_row_q8_0`` on each row of ``x [M, K]`` (the activations of
    its Q8_0 / Q4_0 dot products): per 32 values ``d = max|x| / 127`` stored as float16,
    quants ``round_half_even(x * (127 / max|x|))``.

    Returns:
        ``(qs int8 [M, K], d float32 [M, K/32])`` (d: the float16 value).
    """
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    qs = np.rint((blocks * inv).astype(np.float32)).astype(np.int8)  # rint: half to even
    return qs.reshape(m, k), d.reshape(m, k // 32)


def q80_matmul_reference(x: torch.Tensor, raw: torch.Tensor,
                         qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 / Q4_0 matmul stated plainly: ``x`` rounded by
    :func:`quantize_q8_0_numpy` times the ``gguf`` dequantization of ``raw``, in float64.

    Returns:
        ``(result [M, N], |activations| @ |weights|.T)``.
    """
    qs, d = quantize_q8_0_numpy(x.detach().float().numpy())
    acts = qs.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    w = quants.dequantize(raw.numpy(), qtype).astype(np.float64)
    return torch.from_numpy(acts @ w.T), torch.from_numpy(np.abs(acts) @ np.abs(w).T)
