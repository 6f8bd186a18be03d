"""Test and benchmark helpers: random GGML rows and ggml's Q8_K rounding in plain numpy."""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from inference_engine.cpu_extensions import cpu_isa_flags

from inference_engine_gguf.cpu_kernels import ggml_build
from inference_engine_gguf.q8k_kernels import Q8K_BUILD

__all__ = ["AVX2_Q8K_BUILD", "F16_FIELDS", "PORTABLE_Q8K_BUILD", "block32_matmul_reference",
           "block32_quants_numpy", "cpu_has_avx2", "iq4_xs_matmul_reference",
           "q80_matmul_reference", "q8k_matmul_reference", "quantize_q8_0_numpy",
           "quantize_q8_1_numpy", "quantize_q8_k_numpy", "random_ggml_rows"]

T = GGMLQuantizationType

# The K-quant kernel's source built for the paths this CPU would not take: the plain loops of
# CPUs without AVX2 (with -ffp-contract=off, -mno-fma changes nothing else there), and the
# AVX2 tiles on an AVX-512 CPU.
PORTABLE_Q8K_BUILD = ggml_build(
    "inference_engine_gguf_q8k_portable_test", Q8K_BUILD.sources,
    "the Q8_K kernel without AVX2 / AVX-512 (test)", ("-mno-avx512f", "-mno-avx2", "-mno-fma"))
AVX2_Q8K_BUILD = ggml_build("inference_engine_gguf_q8k_avx2_test", Q8K_BUILD.sources,
                            "the Q8_K kernel for AVX2 (test)", ("-mno-avx512f",))


def cpu_has_avx2() -> bool:
    """Whether :data:`AVX2_Q8K_BUILD` can run here (its code needs AVX2, FMA and F16C)."""
    return {"avx2", "fma", "f16c"} <= set(cpu_isa_flags())


# Byte ranges of each block type that hold float16 scales (kept finite in random rows).
F16_FIELDS: dict[GGMLQuantizationType, list[tuple[int, int]]] = {
    T.Q4_0: [(0, 2)], T.Q4_1: [(0, 4)], T.Q5_0: [(0, 2)], T.Q5_1: [(0, 4)], T.Q8_0: [(0, 2)],
    T.Q2_K: [(80, 84)], T.Q3_K: [(108, 110)], T.Q4_K: [(0, 4)], T.Q5_K: [(0, 4)],
    T.Q6_K: [(208, 210)], T.IQ4_NL: [(0, 2)], T.IQ4_XS: [(0, 2)],
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


def quantize_q8_1_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's x86 ``quantize_row_q8_1`` (the activations of Q4_1 / Q5_1 dot products):
    :func:`quantize_q8_0_numpy`'s quants and fp16 ``d``, plus per block
    ``s = fp16(dd * sum(quants))`` with ``dd = max|x| / 127`` in float32 (before fp16).

    Returns:
        ``(qs int8 [M, K], d float32 [M, K/32], s float32 [M, K/32])`` (d, s: fp16 values).
    """
    qs, d = quantize_q8_0_numpy(x)
    m, k = x.shape
    amax = np.abs(x.astype(np.float32).reshape(m, k // 32, 32)).max(axis=-1)
    dd = (amax / np.float32(127.0)).astype(np.float32)
    sums = qs.reshape(m, k // 32, 32).astype(np.int32).sum(-1).astype(np.float32)
    s = (dd * sums).astype(np.float32).astype(np.float16).astype(np.float32)
    return qs, d, s


_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)
_IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                           1, 13, 25, 38, 53, 69, 89, 113], np.int64)


def block32_quants_numpy(raw: np.ndarray, qtype: GGMLQuantizationType
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 32-value block type's rows ``uint8 [N, row_bytes]`` as ggml's ``block_*`` structs
    read: integer quants (the stored offset removed: ``q - 8`` for Q4_0, ``q - 16`` for Q5_0,
    table values for MXFP4 / IQ4_NL), the scale ``d`` and the min ``m`` (0 where none), so
    that a value is ``d * q + m``.

    Returns:
        ``(q int64 [N, K], d float32 [N, K/32], m float32 [N, K/32])``.
    """
    n = raw.shape[0]
    _, type_size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(n, -1, type_size)
    nb = b.shape[1]

    def f16(lo: int) -> np.ndarray:
        return b[..., lo : lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    def nibbles(lo: int) -> np.ndarray:  # 16 bytes -> 32 values: low nibbles, then high
        qs = b[..., lo : lo + 16].astype(np.int64)
        return np.concatenate([qs & 0xF, qs >> 4], axis=-1)

    def fifth_bits(lo: int) -> np.ndarray:  # qh: bit j is the fifth bit of value j
        qh = b[..., lo : lo + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
        return ((qh[..., None] >> np.arange(32)) & 1) << 4

    m = np.zeros((n, nb), np.float32)
    if qtype == T.Q4_0:
        d, q = f16(0), nibbles(2) - 8
    elif qtype == T.Q4_1:
        d, m, q = f16(0), f16(2), nibbles(4)
    elif qtype == T.Q5_0:
        d, q = f16(0), (nibbles(6) | fifth_bits(2)) - 16
    elif qtype == T.Q5_1:
        d, m, q = f16(0), f16(2), nibbles(8) | fifth_bits(4)
    elif qtype == T.Q8_0:
        d, q = f16(0), b[..., 2:34].view(np.int8).astype(np.int64)
    elif qtype == T.IQ4_NL:
        d, q = f16(0), _IQ4_NL_VALUES[nibbles(2)]
    elif hasattr(T, "MXFP4") and qtype == T.MXFP4:
        # ggml's E8M0_TO_FP32_HALF: 2^(e - 128).
        d = np.ldexp(np.float32(1.0), b[..., 0].astype(np.int32) - 128).astype(np.float32)
        q = _MXFP4_VALUES[nibbles(1)]
    else:
        raise ValueError(f"{qtype.name} is not a 32-value block type")
    return q.reshape(n, nb * 32), d, m


def block32_matmul_reference(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's CPU matmul for a 32-value block type, stated plainly in float64: the
    activations rounded as its ``vec_dot_type`` says (:func:`quantize_q8_0_numpy`, or
    :func:`quantize_q8_1_numpy` for Q4_1 / Q5_1), then per block
    ``d_w * d_a * sum(q_w * q_a)`` plus ``m_w * s_a`` (``ggml_vec_dot_*_q8_*``).

    Returns:
        ``(result [M, N], sum over blocks of |terms|)``: the second scales error bounds.
    """
    xs = x.detach().float().numpy()
    m_rows, k = xs.shape
    if qtype in (T.Q4_1, T.Q5_1):
        qa, da, sa = quantize_q8_1_numpy(xs)
    else:
        qa, da = quantize_q8_0_numpy(xs)
        sa = np.zeros_like(da)
    qw, dw, mw = block32_quants_numpy(raw.numpy(), qtype)
    nb = k // 32
    # [M, N, nb] integer block sums, exactly (int64).
    isums = np.einsum("mbj,nbj->mnb", qa.reshape(m_rows, nb, 32).astype(np.int64),
                      qw.reshape(-1, nb, 32))
    scale = da.astype(np.float64)[:, None, :] * dw.astype(np.float64)[None, :, :]
    mins = sa.astype(np.float64)[:, None, :] * mw.astype(np.float64)[None, :, :]
    terms = scale * isums + mins
    bound = (np.abs(scale) * np.einsum("mbj,nbj->mnb", np.abs(qa.reshape(m_rows, nb, 32))
                                       .astype(np.int64), np.abs(qw.reshape(-1, nb, 32)))
             + np.abs(mins))
    return torch.from_numpy(terms.sum(-1)), torch.from_numpy(bound.sum(-1))


def iq4_xs_matmul_reference(x: torch.Tensor, raw: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's ``ggml_vec_dot_iq4_xs_q8_K`` stated plainly in float64: ``x`` rounded by
    :func:`quantize_q8_k_numpy`; per 256-value block ``d_w * d_a * sum_s ls_s * sum(q_w q_a)``
    over its 8 sub-blocks of 32 (``ls = 4 low | 2 high bits << 4, - 32``; quants from
    IQ4_NL's table), read from the block as ggml's ``block_iq4_xs`` struct lays it out.

    Returns:
        ``(result [M, N], sum over blocks of |terms|)``.
    """
    qa, da = quantize_q8_k_numpy(x.detach().float().numpy())
    m_rows, k = qa.shape
    nb = k // 256
    b = raw.numpy().reshape(raw.shape[0], nb, 136)
    dw = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, nb]
    high = b[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int64)
    sub = np.arange(8)
    low = (b[..., 4 + sub // 2].astype(np.int64) >> (4 * (sub % 2))) & 0xF  # [N, nb, 8]
    ls = (low | (((high[..., None] >> (2 * sub)) & 3) << 4)) - 32
    qs = b[..., 8:].reshape(raw.shape[0], nb, 8, 16).astype(np.int64)
    qw = _IQ4_NL_VALUES[np.concatenate([qs & 0xF, qs >> 4], axis=-1)]  # [N, nb, 8, 32]
    qa4 = qa.reshape(m_rows, nb, 8, 32).astype(np.int64)
    dots = np.einsum("mbsj,nbsj->mnbs", qa4, qw)
    abs_dots = np.einsum("mbsj,nbsj->mnbs", np.abs(qa4), np.abs(qw))
    scale = da.astype(np.float64)[:, None, :] * dw[None, :, :]
    terms = scale * (dots * ls[None]).sum(-1)
    bound = np.abs(scale) * (abs_dots * np.abs(ls)[None]).sum(-1)
    return torch.from_numpy(terms.sum(-1)), torch.from_numpy(bound.sum(-1))
