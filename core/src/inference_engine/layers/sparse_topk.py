"""Top-k selection of cached positions per query, for sparse attention (DeepSeek DSA).

Each row of ``scores [rows, width]`` is one query's indexer score for every
position of its sequence's context; positions a query may not see (the
future, padding past a short row) hold ``-inf``. The selection is the ``k``
highest-scoring visible positions, ties broken by the lowest position first,
returned in ascending position order and padded with ``-1`` when a row has
fewer than ``k`` visible positions. Because the result is a set in a fixed
order, the torch reference (:func:`topk_positions_torch`) and the Triton kernel
(:mod:`inference_engine.layers.triton_sparse_topk`) must agree exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TOPK_IMPLS", "topk_positions", "topk_positions_torch"]


def topk_positions_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: a stable descending sort (equal scores keep position order), the
    first ``k`` columns, ``-inf`` picks dropped, then ascending.

    Args:
        scores: ``[rows, width]`` float scores, ``-inf`` where not visible.
        k: how many to keep per row.

    Returns:
        ``[rows, k]`` int64 positions, ascending, ``-1`` padding at the end.
    """
    rows, width = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    if rows == 0 or width == 0:
        return out
    kk = min(k, width)
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[:, :kk]
    picked = scores.gather(1, order)
    order = torch.where(picked == float("-inf"), width, order)  # width sorts after any position
    order = order.sort(dim=-1).values
    out[:, :kk] = torch.where(order == width, -1, order)
    return out


def _topk_positions_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    from inference_engine.layers.triton_sparse_topk import topk_positions_triton

    return topk_positions_triton(scores, k)


# Implementation name (as the fused-op choice names them) -> function.
TOPK_IMPLS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "torch": topk_positions_torch,
    "cpu": topk_positions_torch,
    "triton": _topk_positions_triton,
}


def topk_positions(scores: torch.Tensor, k: int, impl: str = "torch") -> torch.Tensor:
    """:func:`topk_positions_torch`'s result by the implementation ``impl``."""
    if impl not in TOPK_IMPLS:
        raise ValueError(f"unknown top-k implementation {impl!r}; one of {sorted(TOPK_IMPLS)}")
    return TOPK_IMPLS[impl](scores, k)
