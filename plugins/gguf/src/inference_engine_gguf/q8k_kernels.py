"""Block-type matmuls the way llama.cpp computes them on CPU: 8-bit activations, integer dots.

llama.cpp never multiplies float activations by a K-quant weight: each activation row
is first rounded to Q8_K (per 256 values one float scale ``d = max/-127``-style, int8
values, and the sums of each 16 of them), and ``vec_dot_qN_K_q8_K`` then multiplies
the integer quants exactly in integers, applying the weight's sub-block scales and
mins in integers and the two float scales once per 256-value block. This module does
the same arithmetic in C++, so that our logits on a K-quant GGUF equal llama.cpp's up to
float summation order, and a decode step costs a fraction of the float path's
dequantize-and-FMA:

* Q4_K, Q5_K and Q6_K rows are permuted once at load into tiles of 16 rows
  (:func:`pack_tiles`, the same bytes) for a kernel whose output lanes are the 16 weight
  rows: ``vpdpbusd`` multiplies 4 quants of each row by 4 activations broadcast to all
  lanes (AVX512-BW + VNNI);
* every K-quant can also run from its raw rows: each call unpacks 8 rows at a time into
  bytes and lane scales, then ``vpmaddubsw`` + ``vpdpwssd`` per 64 values (scalar
  loops without AVX512-BW).

The 32-value block types take llama.cpp's other activation roundings (:func:`activation_rounding`):
Q8_0 for Q8_0, Q4_0, Q5_0, IQ4_NL and MXFP4, Q8_1 (with each block's ``s = fp16(d * sum)``, which
the weight's min multiplies) for Q4_1 and Q5_1; IQ4_XS takes Q8_K, its 32-value sub-blocks
scaled by integers inside each 256-value block. Q8_0 and Q4_0 rows in 16s are packed into
tiles too; the rest are unpacked per call (``csrc/q8_block32.h``): one integer dot product
per 32 values, times ``d_w * d_a``, plus ``m_w * s_a`` where the weight has a min.

:func:`quantize_q8_k` and :func:`q8k_linear_reference` are the plain torch statement of
that arithmetic (ggml's ``quantize_row_q8_K_ref`` and the K-quant dot products
written as "dequantized Q8_K activations times dequantized weights", which is what the
integer sums equal); they are the reference the kernel is tested against and the
fallback where it cannot be built.

The C++ is ``csrc/q8k_matmul.cpp`` (with ``csrc/ggml_helpers.h``), built on first use by
:func:`inference_engine_gguf.cpu_kernels.load_ggml_extension` (``INFERENCE_ENGINE_CPU_KERNELS=0``
turns it off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from inference_engine_gguf.cpu_kernels import CSRC_DIR, ggml_build, load_ggml_extension
from inference_engine_gguf.dequant import dequantize

__all__ = ["PACKED_TYPES", "Q80_TYPES", "Q8K_BUILD", "Q81_TYPES", "Q8K_IQ_TYPES", "Q8K_TYPES", "Q8_TYPES",
           "TILE_ROWS",
           "Q8Parts", "activation_rounding", "kernel", "pack_tiles", "packing_available",
           "q8_linear", "q8k_linear", "q8k_linear_reference", "q8k_parts_linear", "quantize_q8_k",
           "unpack_tiles"]

T = GGMLQuantizationType

# Weight types whose llama.cpp CPU dot product takes Q8_K activations (and our kernel has).
Q8K_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
# Weight types llama.cpp's CPU backend multiplies by Q8_0 activations (its vec_dot_type).
Q80_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.Q8_0, T.Q4_0, T.Q5_0, T.IQ4_NL, *((T.MXFP4,) if hasattr(T, "MXFP4") else ())})
# ... and by Q8_1 activations (Q8_0 plus each block's fp16 ``d * sum``, for the weight's min).
Q81_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.Q4_1, T.Q5_1})
# IQ types llama.cpp multiplies by Q8_K activations that the kernel has (unpacked per call:
# 32-value sub-blocks with integer scales, csrc/q8_block32.h).
Q8K_IQ_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.IQ4_XS})
# Every type the kernel multiplies by 8-bit activations.
Q8_TYPES: frozenset[GGMLQuantizationType] = Q8K_TYPES | Q8K_IQ_TYPES | Q80_TYPES | Q81_TYPES
QK_K = 256
# Weight values one float64 tile of the reference path may hold (32 MiB).
REFERENCE_TILE_VALUES = 1 << 22

_STEM = "inference_engine_gguf_q8k"
_SOURCES = [str(CSRC_DIR / "q8k_matmul.cpp")]
Q8K_BUILD = ggml_build(_STEM, _SOURCES, "the CPU K-quant x Q8_K kernel")


def kernel() -> Any | None:
    """The compiled extension, or None where it cannot be built or is turned off."""
    return load_ggml_extension(_STEM, _SOURCES, description=Q8K_BUILD.description)


def activation_rounding(qtype: GGMLQuantizationType) -> str | None:
    """``"Q8_K"``, ``"Q8_0"`` or ``"Q8_1"``: how llama.cpp rounds the activations a weight of
    this type multiplies on CPU; None for the float types (F16 / BF16 round the activations
    to their own type: :func:`inference_engine_gguf.quant_method.tiled_linear` does that)."""
    if qtype in Q8K_TYPES or qtype in Q8K_IQ_TYPES:
        return "Q8_K"
    if qtype in Q80_TYPES:
        return "Q8_0"
    if qtype in Q81_TYPES:
        return "Q8_1"
    return None


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's ``quantize_row_q8_K_ref`` in torch: ``x [M, K]`` float32, ``K % 256 == 0``.

    Per 256 values: the value of largest magnitude ``max`` (the first, on ties) gives
    ``iscale = -127 / max``; quants are ``min(127, round_half_even(iscale * x))``, ``d =
    1 / iscale`` and ``bsums`` the sums of each 16 quants. All-zero blocks get ``d = 0``.

    Returns:
        ``(qs int8 [M, K], d float32 [M, K/256], bsums int16 [M, K/16])``.
    """
    m, k = x.shape
    if k % QK_K:
        raise ValueError(f"Q8_K needs K to be a multiple of {QK_K}, got {k}")
    blocks = x.detach().float().reshape(m, k // QK_K, QK_K)
    first_max = blocks.abs().argmax(dim=-1, keepdim=True)  # argmax returns the first maximum
    peak = blocks.gather(-1, first_max)
    nonzero = peak != 0
    # Tensor / tensor: torch computes ``scalar / tensor`` through a reciprocal, not a division.
    iscale = torch.where(nonzero, torch.full_like(peak, -127.0) / torch.where(nonzero, peak, 1.0),
                         0.0)
    qs = torch.round(iscale * blocks).clamp(max=127).to(torch.int8)  # round: half to even
    d = torch.where(nonzero, torch.ones_like(iscale) / torch.where(nonzero, iscale, 1.0), 0.0)
    bsums = qs.reshape(m, k // 16, 16).sum(dim=-1, dtype=torch.int32).to(torch.int16)
    return qs.reshape(m, k), d.reshape(m, k // QK_K), bsums


def q8k_linear_reference(x: torch.Tensor, raw: torch.Tensor,
                         qtype: GGMLQuantizationType) -> torch.Tensor:
    """``Q8_K(x) @ dequantize(raw).T`` in float64, returned as float32.

    What llama.cpp's integer K-quant dot products equal (they are exact sums of the
    same products, scaled once per block), without their float summation order.
    """
    qs, d, _ = quantize_q8_k(x.reshape(-1, x.shape[-1]))
    acts = (qs.double().reshape(qs.shape[0], -1, QK_K) * d.double().unsqueeze(-1))
    acts = acts.reshape(qs.shape)
    n = raw.shape[0]
    y = torch.empty(acts.shape[0], n, dtype=torch.float32, device=x.device)
    tile = max(1, REFERENCE_TILE_VALUES // acts.shape[1])
    for start in range(0, n, tile):  # at most one tile of float64 weight at a time
        w = dequantize(raw[start : start + tile], qtype).double()
        y[:, start : start + tile] = (acts @ w.t()).float()
    return y.reshape(*x.shape[:-1], n)


def q8k_linear(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """``x [..., K] @ W.T`` with ``x`` rounded to Q8_K first (llama.cpp's CPU arithmetic).

    The C++ kernel where it is built, else :func:`q8k_linear_reference`. Float32 out.
    """
    ext = kernel() if x.device.type == "cpu" else None
    if (ext is not None and x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1
            and raw.is_contiguous()):  # the decode path: no reshapes
        return ext.ggml_linear_q8k(x, raw, int(qtype))
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()
    if ext is None:
        return q8k_linear_reference(x2, raw, qtype).reshape(*lead, raw.shape[0])
    y = ext.ggml_linear_q8k(x2.contiguous(), raw.contiguous(), int(qtype))
    return y.reshape(*lead, y.shape[-1])


def q8_linear(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """``x [..., K] @ W.T`` in llama.cpp's arithmetic for any :data:`Q8_TYPES` weight ``raw``
    (raw rows) on CPU: the activations rounded as :func:`activation_rounding` says. Float32.

    Raises:
        RuntimeError: for a type other than the K-quants where the kernel is not built
            (the K-quants fall back to :func:`q8k_linear_reference`).
    """
    if qtype in Q8K_TYPES:
        return q8k_linear(x, raw, qtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()
    out = x2.new_empty(x2.shape[0], raw.shape[0])
    q8k_parts_linear(x2, Q8Parts([raw.contiguous()], [int(qtype)], [False]), out)
    return out.reshape(*lead, raw.shape[0])


@dataclass(frozen=True, slots=True)
class Q8Parts:
    """A layer's parts, ready for :func:`q8k_parts_linear` (built once at load), all of one
    :func:`activation_rounding`: K-quants and IQ4_XS against Q8_K activations, Q8_0 / Q4_0 /
    Q5_0 / IQ4_NL / MXFP4 against Q8_0 ones, Q4_1 / Q5_1 against Q8_1 ones."""

    weights: list[torch.Tensor]  # raw rows, or pack_tiles tiles where packed[i]
    qtypes: list[int]
    packed: list[bool]


def q8k_parts_linear(x: torch.Tensor, parts: Q8Parts, out: torch.Tensor) -> None:
    """``out = Q(x) @ [W_0; W_1; ...].T`` for float32 ``x [T, K]`` on CPU in one kernel call,
    ``Q`` llama.cpp's activation rounding for the parts' types (Q8_K, Q8_0 or Q8_1).

    Raises:
        RuntimeError: if the kernel is unavailable (the caller built ``parts`` with it).
    """
    ext = kernel()
    if ext is None:
        raise RuntimeError("the CPU K-quant x Q8_K kernel is not available")
    ext.q8k_parts_into(x if x.stride(-1) == 1 else x.contiguous(), parts.weights, parts.qtypes,
                       parts.packed, out)


# Byte fields of a block, in tile order: (first byte, end, interleaving unit in bytes).
_TILE_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, int, int], ...]] = {
    T.Q4_K: ((0, 2, 2), (2, 4, 2), (4, 16, 4), (16, 144, 4)),  # d, dmin, scales, quants
    T.Q5_K: ((0, 2, 2), (2, 4, 2), (4, 16, 4), (16, 48, 4), (48, 176, 4)),  # ..., qh, quants
    T.Q6_K: ((208, 210, 2), (192, 208, 4), (0, 128, 4), (128, 192, 4)),  # d, scales, ql, qh
    T.Q8_0: ((0, 2, 2), (2, 34, 4)),  # d, quants
    T.Q4_0: ((0, 2, 2), (2, 18, 4)),  # d, quant bytes
}
TILE_ROWS = 16
PACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_TILE_FIELDS)


def packing_available() -> bool:
    """Whether the kernel for :func:`pack_tiles` tiles is built here (AVX512-BW + VNNI, or
    AVX2 + FMA + F16C: ``csrc/q8_tile_simd.h``)."""
    ext = kernel()
    return ext is not None and bool(ext.packed_available())


def pack_tiles(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Raw rows ``uint8 [N, nb * type_size]`` (N a multiple of 16) -> ``[N / 16, nb * tile]``.

    A tile is one block of 16 consecutive rows with each field (fp16 scales, 6-bit scale
    bytes, quants) interleaved across the 16 rows in 2- or 4-byte units: the same bytes,
    laid out so the kernel loads one unit of all 16 rows at once (the output lanes are
    weight rows). :func:`unpack_tiles` is the inverse.
    """
    fields = _TILE_FIELDS[qtype]
    n, row_bytes = raw.shape
    type_size = GGML_QUANT_SIZES[qtype][1]
    if n % TILE_ROWS or row_bytes % type_size:
        raise ValueError(f"{qtype.name} tiles need rows in multiples of {TILE_ROWS} "
                         f"(got {n}) and whole blocks")
    nb = row_bytes // type_size
    blocks = raw.reshape(n // TILE_ROWS, TILE_ROWS, nb, type_size)
    parts = []
    for start, end, unit in fields:
        field = blocks[..., start:end].reshape(n // TILE_ROWS, TILE_ROWS, nb, -1, unit)
        parts.append(field.permute(0, 2, 3, 1, 4).reshape(n // TILE_ROWS, nb, -1))
    return torch.cat(parts, dim=-1).reshape(n // TILE_ROWS, -1).contiguous()


def unpack_tiles(packed: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The raw rows ``uint8 [N, nb * type_size]`` of :func:`pack_tiles` tiles."""
    fields = _TILE_FIELDS[qtype]
    type_size = GGML_QUANT_SIZES[qtype][1]
    num_tiles = packed.shape[0]
    nb = packed.shape[1] // (type_size * TILE_ROWS)
    tiles = packed.reshape(num_tiles, nb, TILE_ROWS * type_size)
    raw = torch.empty(num_tiles, TILE_ROWS, nb, type_size, dtype=torch.uint8)
    offset = 0
    for start, end, unit in fields:
        size = (end - start) * TILE_ROWS
        field = tiles[..., offset : offset + size].reshape(num_tiles, nb, -1, TILE_ROWS, unit)
        raw[..., start:end] = field.permute(0, 3, 1, 2, 4).reshape(num_tiles, TILE_ROWS, nb, -1)
        offset += size
    return raw.reshape(num_tiles * TILE_ROWS, nb * type_size)
