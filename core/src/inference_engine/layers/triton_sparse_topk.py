"""Triton top-k selection over the variable-length rows of a mixed batch (DSA indexer scores).

One program per row. Scores are mapped to order-preserving int32 keys (a
float's bits, with the magnitude bits flipped for negatives), and the ``k``-th
largest key ``T`` is found by bisection over the int32 range (32 counting
passes over the row). A final pass in position order keeps every key above
``T`` plus the first ``k - count(> T)`` keys equal to ``T`` (lowest positions
first, by a running count), writing each kept position at its rank among the
kept ones, so the output is ascending. Rows with at most ``k`` visible
(finite) scores keep all of them. The result equals
:func:`~inference_engine.layers.sparse_topk.topk_positions_torch` exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["topk_positions_triton"]


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (negatives: magnitude bits flipped; -0.0 is
    first made +0.0, as the two compare equal)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _topk_rows_kernel(scores_ptr, out_ptr, width, stride_row, k,
                      BLOCK: tl.constexpr) -> None:
    row = tl.program_id(0)
    base = scores_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    neg_inf_key = _order_key(tl.full((), float("-inf"), tl.float32))
    # How many visible (finite) scores the row has.
    visible = tl.zeros((), tl.int32)
    for start in range(0, width, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < width, other=float("-inf"))
        visible += tl.sum((_order_key(x) > neg_inf_key).to(tl.int32), axis=0)
    # Threshold: the k-th largest key (bisection), or "every visible one".
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    if visible > k:
        for _ in range(32):
            mid = (lo + hi + 1) // 2
            count = tl.zeros((), tl.int32)
            for start in range(0, width, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < width,
                            other=float("-inf"))
                count += tl.sum((_order_key(x).to(tl.int64) >= mid).to(tl.int32), axis=0)
            lo = tl.where(count >= k, mid, lo)
            hi = tl.where(count >= k, hi, mid - 1)
        threshold = lo
        above = tl.zeros((), tl.int32)
        for start in range(0, width, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < width, other=float("-inf"))
            above += tl.sum((_order_key(x).to(tl.int64) > threshold).to(tl.int32), axis=0)
        equal_wanted = k - above
    else:
        threshold = neg_inf_key.to(tl.int64)
        equal_wanted = tl.zeros((), tl.int32)
    # Keep, in position order, writing each kept position at its rank.
    kept_before = tl.zeros((), tl.int32)
    equal_before = tl.zeros((), tl.int32)
    for start in range(0, width, BLOCK):
        in_row = start + offs < width
        key = _order_key(tl.load(base + start + offs, mask=in_row,
                                 other=float("-inf"))).to(tl.int64)
        equal = (key == threshold) & in_row
        equal_rank = equal_before + tl.cumsum(equal.to(tl.int32), axis=0) - equal.to(tl.int32)
        keep = (key > threshold) | (equal & (equal_rank < equal_wanted))
        keep = keep & in_row
        rank = kept_before + tl.cumsum(keep.to(tl.int32), axis=0) - keep.to(tl.int32)
        tl.store(out_ptr + row.to(tl.int64) * k + rank, (start + offs).to(tl.int64), mask=keep)
        kept_before += tl.sum(keep.to(tl.int32), axis=0)
        equal_before += tl.sum(equal.to(tl.int32), axis=0)


def topk_positions_triton(scores: torch.Tensor, k: int, block: int = 1024) -> torch.Tensor:
    """``[rows, k]`` int64 ascending positions of each row's top ``k`` finite scores, ``-1``
    padded (see :mod:`inference_engine.layers.sparse_topk`).

    Args:
        scores: ``[rows, width]`` float32 (other floats are converted), ``-inf`` where a
            position is not visible.
        k: how many to keep per row (>= 1).
        block: positions read per loop iteration (a power of two).
    """
    if k < 1:
        raise ValueError(f"top-k needs k >= 1, got {k}")
    rows, width = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    if rows == 0 or width == 0:
        return out
    scores = scores.float().contiguous()
    block = min(block, triton.next_power_of_2(width))
    _topk_rows_kernel[(rows,)](scores, out, width, scores.stride(0), k, BLOCK=block)
    return out
