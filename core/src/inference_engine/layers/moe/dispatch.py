"""Token dispatch: the (token, slot) pairs of a step grouped by expert.

Both the CPU path and the Triton kernel work on tokens sorted by expert, so
each expert's rows are contiguous and experts that received nothing cost
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertDispatch", "align_block_size", "sort_by_expert"]


@dataclass(frozen=True, slots=True)
class ExpertDispatch:
    """The step's ``T * k`` assignments ordered by expert."""

    # [T*k] flat assignment index (token * k + slot) in expert order (stable).
    order: torch.Tensor
    # [T*k] the token each sorted assignment reads.
    token_of: torch.Tensor
    # Host list: assignments per expert, [num_experts].
    counts: list[int]


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertDispatch:
    """Group ``ids [T, k]`` by expert (stable, so a token's order within an expert is kept)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertDispatch(order, order // ids.shape[1], counts)


def align_block_size(ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sorted assignments padded so every block of ``block_m`` rows has one expert.

    Returns:
        ``sorted_ids [num_padded]`` (flat assignment index, ``T*k`` for padding),
        ``block_expert [num_padded // block_m]`` (expert of each block) and
        ``num_padded``. Experts with no tokens get no block.
    """
    flat = ids.reshape(-1)
    numel = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    num_padded = int(padded_counts.sum())
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(padded_counts, 0) - padded_counts  # padded start of each expert
    raw_starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(numel, device=flat.device) - raw_starts[sorted_experts]
    sorted_ids = torch.full((num_padded,), numel, dtype=torch.int64, device=flat.device)
    sorted_ids[starts[sorted_experts] + rank] = order
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded_counts // block_m
    )
    return sorted_ids, block_expert, num_padded
