"""What a layer keeps per sequence, at a fixed size, beside the paged KV cache.

Recurrent layers (Mamba-2's conv window and SSM state; a compressor's running
sums) carry a state whose size does not grow with the context, and an
encoder-decoder's cross-attention reads K/V of a fixed-length encoder output
(Whisper), so paging either by token makes no sense: each running sequence owns
one *slot* of a per-sequence pool instead. A layer declares its state by
answering ``state_cache_spec()`` with a :class:`StateCacheSpec`; the model
runner allocates one tensor per declared entry with a leading slot dimension and
binds them to the layer's ``state_cache`` attribute. The step's slot of every
sequence reaches the layer as ``AttentionMetadata.state_slots``. A model with no
such layer has no state pool at all (docs/engine.md, "Per-sequence state cache").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StateCacheSpec", "StateTensorSpec"]


@dataclass(frozen=True, slots=True)
class StateTensorSpec:
    """One per-sequence state tensor: its shape for one sequence and its dtype."""

    # Shape of one sequence's state (the pool prepends the slot dimension).
    shape: tuple[int, ...]
    dtype: torch.dtype

    def num_bytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class StateCacheSpec:
    """Every per-sequence state tensor of one layer, in the order the layer binds them.

    Contract: a slot's content is garbage when a sequence receives it; the layer starts
    from zeros for a sequence with no computed context (``seq_len == query_len``) and
    from the slot's content otherwise, and leaves the state after the step's last token
    in the slot. So chunked prefill carries the state across chunks, recompute after
    preemption starts clean, and nothing has to be zeroed on allocation.

    State written once rather than carried by recurrence (an encoder-decoder's
    cross-attention K/V of its encoder output) keeps the same contract: the step where a
    sequence has no computed context writes the whole slot (the encoder runs then), every
    later step only reads it. Preemption frees the slot, so recompute writes it again.
    """

    tensors: tuple[StateTensorSpec, ...]

    def bytes_per_seq(self) -> int:
        return sum(t.num_bytes() for t in self.tensors)
