"""Token dispatch: the (token, slot) pairs of a step grouped by expert.

Both the torch path and the Triton kernel work on tokens sorted by expert, so
each expert's rows are contiguous and experts that received nothing cost
nothing. Nothing here reads a tensor back to the host: sizes that depend on
the routing are bounded statically (:func:`max_padded_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertDispatch", "align_block_size", "expert_counts", "max_padded_size",
           "sort_by_expert"]


@dataclass(frozen=True, slots=True)
class ExpertDispatch:
    """The step's ``T * k`` assignments ordered by expert (device tensors only)."""

    # [T*k] flat assignment index (token * k + slot) in expert order (stable).
    order: torch.Tensor
    # [T*k] the token each sorted assignment reads.
    token_of: torch.Tensor
    # [num_experts] int64 assignments per expert.
    counts: torch.Tensor
    # [num_experts] int32 end of each expert's rows in sorted order (``grouped_mm``'s offs).
    ends: torch.Tensor
    # [T*k] int64 expert of each sorted assignment.
    sorted_experts: torch.Tensor


def expert_counts(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[num_experts]`` int64 assignments per expert, without reading ids back.

    NOTE: ``torch.bincount`` on CUDA reads the ids' maximum to size its output (a host
    sync even with ``minlength``); a scatter-add into a fixed-size tensor does not.
    """
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertDispatch:
    """Group ``ids [T, k]`` by expert (stable, so a token's order within an expert is kept)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    return ExpertDispatch(order, order // ids.shape[1], counts, ends, flat[order])


def max_padded_size(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Static bound on :func:`align_block_size`'s padded rows: each expert with tokens
    wastes at most ``block_m - 1`` rows, and the padded count is a multiple of ``block_m``."""
    bound = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return bound // block_m * block_m


def align_block_size(ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted assignments padded so every block of ``block_m`` rows has one expert.

    The outputs have the static size :func:`max_padded_size` (nothing is read back
    to the host); rows past the padded count are padding, and so are their blocks.

    Returns:
        ``sorted_ids [max_padded]`` (flat assignment index, ``T*k`` for padding),
        ``block_expert [max_padded // block_m]`` (expert of each block; 0 past the
        used blocks) and ``num_padded [1]`` int64, the rows in use (a multiple of
        ``block_m``). Experts with no tokens get no block.
    """
    flat = ids.reshape(-1)
    numel = flat.numel()
    device = flat.device
    max_padded = max_padded_size(numel, num_experts, block_m)
    counts = expert_counts(flat, num_experts)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    order = torch.argsort(flat, stable=True)
    starts = padded_ends - padded_counts  # padded start of each expert
    raw_starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(numel, device=device) - raw_starts[sorted_experts]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, starts[sorted_experts] + rank, order)
    # Block b belongs to the first expert whose padded rows end after it.
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert.masked_fill_(block_expert >= num_experts, 0)
    return sorted_ids, block_expert, padded_ends[-1:]
