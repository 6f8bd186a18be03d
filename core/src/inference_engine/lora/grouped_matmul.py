"""The grouped LoRA products (punica's shrink and expand) as plain torch: the reference.

A step's tokens come from sequences with different adapters. Each adapter
held on the device owns a slot of stacked weights, ``lora_a [slots, R, K]``
and ``lora_b [slots, N, R]``; the step's tokens are grouped by slot (vLLM
sorts them by adapter and runs one segment per adapter), and each group is
multiplied by its own slot: *shrink* ``x [T, K] -> [T_g, R]`` then *expand*
``[T_g, R] -> [T_g, N]`` added into the layer's output. Tokens without an
adapter are in no group and are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenGroup", "lora_delta_reference", "lora_expand", "lora_shrink"]


@dataclass(frozen=True, slots=True)
class TokenGroup:
    """The tokens of one step that use the adapter in ``slot``."""

    slot: int
    # [T_g] int64 token rows on the device; None: every token of the step.
    rows: torch.Tensor | None


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor,
                groups: list[TokenGroup]) -> list[torch.Tensor]:
    """``x [T, K]`` -> per group ``x[rows] @ lora_a[slot]^T``, ``[T_g, R]``."""
    return [(x if g.rows is None else x.index_select(0, g.rows)) @ lora_a[g.slot].t()
            for g in groups]


def lora_expand(shrunk: list[torch.Tensor], lora_b: torch.Tensor, groups: list[TokenGroup],
                out: torch.Tensor) -> torch.Tensor:
    """Add each group's ``shrunk @ lora_b[slot]^T`` (``[T_g, N]``) into its rows of
    ``out [T, N]`` in place; returns ``out``."""
    for g, s in zip(groups, shrunk, strict=True):
        delta = s @ lora_b[g.slot].t()
        if g.rows is None:
            out.add_(delta)
        else:
            out.index_add_(0, g.rows, delta)
    return out


def lora_delta_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         groups: list[TokenGroup], out: torch.Tensor) -> torch.Tensor:
    """Shrink then expand into ``out`` in place (the signature the Triton kernel shares)."""
    return lora_expand(lora_shrink(x, lora_a, groups), lora_b, groups, out)
