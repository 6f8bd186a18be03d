"""Packing of 4/8-bit integers into int32 words, in the orders the Hub's formats use.

Three layouts reach us:

* GPTQ ``qweight [K/pack, N]`` and compressed-tensors ``weight_packed [N, K/pack]``:
  ``pack = 32 / bits`` consecutive values along the packed dimension, value
  ``j`` of a word in bits ``j*bits .. j*bits+bits-1`` (AutoGPTQ ``pack``:
  ``qweight[row] |= intweight[j] << (bits * (j - i))``; compressed-tensors
  ``pack_to_int32``: element ``i`` at bit ``i * bits``, the same for 4 and 8 bits).
* AWQ (GEMM) ``qweight [K, N/8]`` and ``qzeros [G, N/8]``: packed along N in the
  interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]``: nibble ``i`` of a word holds
  column ``order[i]`` of its eight (AutoAWQ ``WQLinear_GEMM.from_linear``).

All values are unsigned (``0 .. 2^bits - 1``); signed formats add their offset
before packing. The runtime layout of every weight-only method is the GPTQ one
(packed along K, sequential), which the Triton kernel and the reference read.
"""

from __future__ import annotations

import torch

__all__ = [
    "AWQ_ORDER",
    "pack_along",
    "pack_factor",
    "unpack_along",
]

# Column held by nibble i of an AWQ word.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_factor(bits: int) -> int:
    """Values per int32 word.

    Raises:
        ValueError: for a width other than 4 or 8.
    """
    if bits not in (4, 8):
        raise ValueError(f"only 4- and 8-bit integer weights are supported, got {bits} bits")
    return 32 // bits


def _order(bits: int, interleaved: bool) -> list[int]:
    pack = pack_factor(bits)
    if not interleaved:
        return list(range(pack))
    if bits != 4:
        raise ValueError("the AWQ interleaved order is defined for 4-bit values only")
    return list(AWQ_ORDER)


def unpack_along(packed: torch.Tensor, bits: int, dim: int,
                 interleaved: bool = False) -> torch.Tensor:
    """Unsigned values (int32) from int32 words packed along ``dim`` (0 or 1).

    ``interleaved`` reads AWQ's order; the result has ``pack`` times as many
    entries along ``dim``.
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed integer weights must be int32, got {packed.dtype}")
    pack = pack_factor(bits)
    mask = (1 << bits) - 1
    shifts = torch.arange(pack, dtype=torch.int32, device=packed.device) * bits
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, pack, 1)) & mask  # [R, pack, C]
        order = _order(bits, interleaved)
        if interleaved:
            values = values[:, _inverse(order)]
        return values.reshape(-1, packed.shape[1])
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, pack)) & mask  # [R, C, pack]
    if interleaved:
        values = values[:, :, _inverse(_order(bits, interleaved))]
    return values.reshape(packed.shape[0], -1)


def _inverse(order: list[int]) -> list[int]:
    """Position of each column in the word: ``inv[order[i]] = i``."""
    inv = [0] * len(order)
    for i, column in enumerate(order):
        inv[column] = i
    return inv


def pack_along(values: torch.Tensor, bits: int, dim: int,
               interleaved: bool = False) -> torch.Tensor:
    """int32 words from unsigned ``values`` packed along ``dim`` (a multiple of ``pack`` long).

    The inverse of :func:`unpack_along`; used to repack checkpoints into the
    runtime layout (and by tests writing checkpoints).
    """
    pack = pack_factor(bits)
    if values.shape[dim] % pack:
        raise ValueError(f"cannot pack {values.shape[dim]} values along dim {dim} into words of "
                         f"{pack}")
    v = values.to(torch.int32)
    if int(v.min()) < 0 or int(v.max()) >= (1 << bits):
        raise ValueError(f"values out of the unsigned {bits}-bit range")
    order = _order(bits, interleaved)
    if dim == 0:
        v = v.reshape(-1, pack, v.shape[1])[:, order]
        words = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int32, device=v.device)
        for i in range(pack):
            words |= v[:, i] << (i * bits)
        return words
    v = v.reshape(v.shape[0], -1, pack)[:, :, order]
    words = torch.zeros(v.shape[0], v.shape[1], dtype=torch.int32, device=v.device)
    for i in range(pack):
        words |= v[:, :, i] << (i * bits)
    return words
