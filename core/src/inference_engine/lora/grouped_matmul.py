"""The grouped LoRA products (punica's shrink and expand) in torch: the reference, and
the CPU path.

A step's tokens come from sequences with different adapters. Each adapter
held on the device owns a slot of stacked weights, ``lora_a [slots, R', K]``
and ``lora_b [slots, N, R']`` (a fused layer's parts side by side in ``R'``,
``B`` zero outside each part's block). The tokens that have an adapter are
laid out slot by slot (:class:`StepSegments`, vLLM's sorted token-to-adapter
mapping) and each segment is multiplied by its own slot: *shrink*
``x [T_g, K] -> [T_g, R']``, then *expand* ``-> [T_g, N]``, added into the
layer's output. Tokens without an adapter are in no segment and are left as
they are.

In torch the segments are padded to the longest one and run as two batched
matmuls (five ops per layer however many adapters the step has: small ops
cost more in dispatch than in arithmetic on a CPU); padded rows are zeroed
after the shrink, so they add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["StepSegments", "lora_delta_reference", "make_segments"]


@dataclass(frozen=True, slots=True)
class StepSegments:
    """The tokens of one step that use an adapter, slot by slot (built once per step)."""

    # The slot of each segment, and where segment g starts in ``order`` (G + 1 offsets).
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    # [T_a] int64 token rows, segment after segment; None: every token, one segment.
    order: torch.Tensor | None
    # [G * L] token rows with each segment padded to the longest (L) by repeating its first
    # row, [G, L, 1] 1/0 for real/padded rows, [G] the slots; None with ``order``.
    padded_order: torch.Tensor | None = None
    pad_mask: torch.Tensor | None = None
    slot_index: torch.Tensor | None = None

    @property
    def longest(self) -> int:
        return max(b - a for a, b in zip(self.starts[:-1], self.starts[1:], strict=True))


def make_segments(slot_of_token: list[int], device: torch.device,
                  dtype: torch.dtype) -> StepSegments | None:
    """Segments of a step whose token ``t`` uses slot ``slot_of_token[t]`` (-1: none)."""
    slots_np = np.asarray(slot_of_token, dtype=np.int64)
    present = sorted(set(slot_of_token) - {-1})
    if not present:
        return None
    if len(present) == 1 and (slots_np >= 0).all():
        return StepSegments((present[0],), (0, len(slot_of_token)), None)
    order = np.argsort(slots_np, kind="stable")
    order = order[slots_np[order] >= 0]
    counts = [int((slots_np == s).sum()) for s in present]
    starts = np.concatenate([[0], np.cumsum(counts)])
    longest = max(counts)
    padded = np.empty((len(present), longest), dtype=np.int64)
    mask = np.zeros((len(present), longest, 1), dtype=np.float32)
    for g, n in enumerate(counts):
        rows = order[starts[g]:starts[g + 1]]
        padded[g, :n] = rows
        padded[g, n:] = rows[0]
        mask[g, :n] = 1.0
    return StepSegments(
        tuple(present), tuple(int(s) for s in starts),
        torch.from_numpy(order).to(device, non_blocking=True),
        torch.from_numpy(padded.reshape(-1)).to(device, non_blocking=True),
        torch.from_numpy(mask).to(device=device, dtype=dtype),
        torch.tensor(present, dtype=torch.int64, device=device))


def _stacked(weights: torch.Tensor, seg: StepSegments) -> torch.Tensor:
    """``weights[seg.slots]``: a view when the slots are consecutive, else a gather."""
    first = seg.slots[0]
    if seg.slots == tuple(range(first, first + len(seg.slots))):
        return weights[first:first + len(seg.slots)]
    return weights.index_select(0, seg.slot_index)


def lora_delta_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         seg: StepSegments, out: torch.Tensor) -> torch.Tensor:
    """``out[t] += x[t] A_s^T B_s^T`` for every token ``t`` of a segment of slot ``s``, in
    place; ``x [T, K]``, ``out [T, N]``; returns ``out``."""
    if seg.order is None:
        slot = seg.slots[0]
        return out.addmm_(x @ lora_a[slot].t(), lora_b[slot].t())
    groups, longest = len(seg.slots), seg.longest
    xs = x.index_select(0, seg.padded_order).view(groups, longest, x.shape[1])
    shrunk = torch.bmm(xs, _stacked(lora_a, seg).transpose(1, 2)).mul_(seg.pad_mask)
    delta = torch.bmm(shrunk, _stacked(lora_b, seg).transpose(1, 2))
    return out.index_add_(0, seg.padded_order, delta.view(-1, out.shape[1]))
