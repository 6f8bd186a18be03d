"""GGML block dequantization in torch, bit for bit equal to ``gguf.quants.dequantize``.

Each function takes blocks ``uint8 [n_blocks, type_size]`` and returns float32
``[n_blocks, block_size]``. They follow the ``gguf`` package's numpy reference
operation by operation (same float32 products and sums, no fused multiply-add),
which is what makes the results identical, not merely close. The scale and
offset are applied in place on the freshly made float tensor (one float
buffer per call: these run on every matmul).

:func:`dequantize` is the entry point: raw rows ``[..., row_bytes]`` (or a float
tensor for F32/F16/BF16) to float32 ``[..., K]``; it runs on whatever device the
raw tensor is on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf.constants import QK_K, GGMLQuantizationType

from inference_engine_gguf.ggml_types import FLOAT_TYPES, block_geometry, check_supported

__all__ = ["dequantize", "dequantize_blocks"]

T = GGMLQuantizationType
_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def _const(name: str, values: list[int], dtype: torch.dtype, shape: tuple[int, ...],
           device: torch.device) -> torch.Tensor:
    """Small shift/lookup tables, built once per device."""
    key = (name, device)
    table = _cache.get(key)
    if table is None:
        table = torch.tensor(values, dtype=dtype, device=device).reshape(shape)
        _cache[key] = table
    return table


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 2m]`` -> float32 ``[n, m]`` (little-endian IEEE half)."""
    return b.contiguous().view(torch.float16).float()


def _shifted(q: torch.Tensor, shifts: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    return q >> _const(f"shift{shifts}{shape}", shifts, torch.uint8, shape, q.device)


def _fields(q: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """Bit fields of every byte: uint8 ``[n, G, L]`` -> ``[n, G, len(shifts), L]``,
    field ``i`` of byte ``l`` being ``(q[..., l] >> shifts[i]) & mask``.

    Works four bytes at a time on int32 words (``L`` must be a multiple of 4): the
    repeated byte mask keeps each byte's field and drops what a shift carried in
    from its neighbour (or the sign), so the result is the same as per byte.
    """
    n, groups, length = q.shape
    words = q.contiguous().view(torch.int32)  # [n, G, L / 4]
    out = torch.empty(n, groups, len(shifts), length // 4, dtype=torch.int32, device=q.device)
    word_mask = mask * 0x01010101
    for i, shift in enumerate(shifts):
        torch.bitwise_and(words >> shift if shift else words, word_mask, out=out[:, :, i])
    return out.view(torch.uint8).view(n, groups, len(shifts), length)


_NIBBLES = [0, 4]
_CRUMBS = [0, 2, 4, 6]
_BITS = list(range(8))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = _fields(b[:, 2:].reshape(n, 1, 16), _NIBBLES, 0x0F)
    q = (qs.reshape(n, -1).view(torch.int8) - 8).float()
    return q.mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _fields(b[:, 4:].reshape(n, 1, 16), _NIBBLES, 0x0F).reshape(n, -1).float()
    return q.mul_(d).add_(m)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 4]`` (a little-endian uint32) -> its 32 bits ``[n, 32]``, bit 0 first."""
    bits = _shifted(qh.unsqueeze(-1), list(range(8)), (1, 1, 8))
    return (bits & 1).reshape(qh.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qh = _bits32(b[:, 2:6])
    ql = _fields(b[:, 6:].reshape(n, 1, 16), _NIBBLES, 0x0F).reshape(n, -1)
    q = ((ql | (qh << 4)).view(torch.int8) - 16).float()
    return q.mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    qh = _bits32(b[:, 4:8])
    ql = _fields(b[:, 8:].reshape(n, 1, 16), _NIBBLES, 0x0F).reshape(n, -1)
    q = (ql | (qh << 4)).float()
    return q.mul_(d).add_(m)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    x = b[:, 2:].view(torch.int8).float()
    return x.mul_(d)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, : QK_K // 16], b[:, QK_K // 16 : QK_K // 16 + QK_K // 4]
    d = _f16(b[:, -4:-2])
    dmin = _f16(b[:, -2:])
    dl = (d * (scales & 0x0F).float()).reshape(n, QK_K // 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, QK_K // 16, 1)
    q = _fields(qs.reshape(n, 2, 32), _CRUMBS, 0x03)
    q = q.reshape(n, QK_K // 16, 16).float()
    return q.mul_(dl).sub_(ml).reshape(n, -1)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, : QK_K // 8]
    qs = b[:, QK_K // 8 : QK_K // 8 + QK_K // 4]
    scales = b[:, QK_K // 8 + QK_K // 4 : -2]
    d = _f16(b[:, -2:])
    lscales = _shifted(scales[:, :8].reshape(n, 1, 8), [0, 4], (1, 2, 1)).reshape(n, 16)
    hscales = _shifted(scales[:, 8:].reshape(n, 1, 4), [0, 2, 4, 6], (1, 4, 1)).reshape(n, 16)
    sc = (lscales & 0x0F) | ((hscales & 0x03) << 4)
    sc = (sc.to(torch.int8) - 32).float()
    dl = (d * sc).reshape(n, 16, 1)
    ql = _fields(qs.reshape(n, 2, 32), _CRUMBS, 0x03).reshape(n, 16, QK_K // 16)
    qh = _fields(hmask.reshape(n, 1, 32), _BITS, 0x01).reshape(n, 16, QK_K // 16)
    qh = qh ^ 1  # the offset is zero when the mask bit is 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return q.mul_(dl).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, ``uint8 [n, 8]`` each."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0:1], s[:, 1:2], s[:, 2:3]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dd = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    q = _fields(b[:, 16:].reshape(n, 4, 32), _NIBBLES, 0x0F).reshape(n, -1, 32).float()
    return q.mul_(dd).sub_(dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh, qs = b[:, 16 : 16 + QK_K // 8], b[:, 16 + QK_K // 8 :]
    dd = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    ql = _fields(qs.reshape(n, 4, 32), _NIBBLES, 0x0F).reshape(n, -1, 32)
    qh = _fields(qh.reshape(n, 1, 32), _BITS, 0x01).reshape(n, -1, 32)
    q = (ql | (qh << 4)).float()
    return q.mul_(dd).sub_(dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, : QK_K // 2]
    qh = b[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    scales = b[:, QK_K // 2 + QK_K // 4 : -2].contiguous().view(torch.int8).float()
    d = _f16(b[:, -2:])
    dd = (d * scales).reshape(n, QK_K // 16, 1)
    ql = _fields(ql.reshape(n, 2, 64), _NIBBLES, 0x0F).reshape(n, -1, 32)
    qh = _fields(qh.reshape(n, 2, 32), _CRUMBS, 0x03).reshape(n, -1, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    q = q.reshape(n, QK_K // 16, -1).float()
    return q.mul_(dd).reshape(n, QK_K)


_MXFP4_VALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]  # e2m1, doubled


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    e = b[:, :1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits (subnormal for e < 2).
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    qs = _shifted(b[:, 1:].reshape(n, 1, 16), [0, 4], (1, 2, 1)) & 0x0F
    table = _const("mxfp4", _MXFP4_VALUES, torch.int8, (16,), b.device)
    q = table[qs.long()].reshape(n, 32)
    return q.float().mul_(d)


_IQ4_NL_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = _shifted(b[:, 2:].reshape(n, 1, 16), [0, 4], (1, 2, 1)) & 0x0F
    table = _const("iq4_nl", _IQ4_NL_VALUES, torch.int8, (16,), b.device)
    return table[qs.long()].reshape(n, 32).float().mul_(d)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])  # [n, 1]
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, 1]
    low = _shifted(b[:, 4:8].reshape(n, 4, 1), [0, 4], (1, 1, 2)).reshape(n, 8) & 0x0F
    shifts = _const("iq4_xs_high", [2 * i for i in range(8)], torch.int32, (1, 8), b.device)
    scales = (low.to(torch.int32) | (((high >> shifts) & 3) << 4)) - 32
    dl = (d * scales.float()).reshape(n, 8, 1)
    qs = _shifted(b[:, 8:].reshape(n, 8, 1, 16), [0, 4], (1, 1, 2, 1)) & 0x0F
    table = _const("iq4_nl", _IQ4_NL_VALUES, torch.int8, (16,), b.device)
    q = table[qs.long()].reshape(n, 8, 32).float()
    return (dl * q).reshape(n, QK_K)


_BLOCK_FNS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
}
if hasattr(T, "MXFP4"):
    _BLOCK_FNS[T.MXFP4] = _mxfp4


def dequantize_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """uint8 ``[n_blocks, type_size]`` -> float32 ``[n_blocks, block_size]``."""
    return _BLOCK_FNS[qtype](blocks)


def dequantize(raw: torch.Tensor, qtype: int | GGMLQuantizationType) -> torch.Tensor:
    """Raw GGML rows to float32 values.

    Args:
        raw: for F32/F16/BF16 a float tensor ``[..., K]`` of that dtype (or its
            bytes as uint8 ``[..., 2K]``/``[..., 4K]``); for block types uint8
            ``[..., row_bytes]``.
        qtype: the GGML type of ``raw``.

    Returns:
        float32 ``[..., K]`` (``raw`` itself for F32 stored as float32).

    Raises:
        UnsupportedGGMLTypeError: naming a type this plugin does not handle.
    """
    qtype = check_supported(qtype)
    if qtype in FLOAT_TYPES:
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        if raw.dtype == torch.uint8:
            raw = raw.contiguous().view(dtype)
        return raw.float()
    block_size, type_size = block_geometry(qtype)
    lead = raw.shape[:-1]
    if raw.shape[-1] % type_size:
        raise ValueError(f"{qtype.name} rows of {raw.shape[-1]} bytes are not whole blocks")
    blocks = raw.reshape(-1, type_size)
    values = _BLOCK_FNS[qtype](blocks)
    return values.reshape(*lead, raw.shape[-1] // type_size * block_size)
