"""A linear layer's LoRA slots: the device copies of every loaded adapter's matrices for it.

A fused layer (q/k/v, gate/up) holds its parts' adapters side by side: part
``p`` uses ranks ``p*max_rank .. p*max_rank + r`` of ``lora_a`` and writes only
its own output rows through ``lora_b``, so the whole fused output gets its delta
from one shrink and one expand. The scaling is folded into ``lora_b`` on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import LinearBase
from inference_engine.lora.grouped_matmul import TokenGroup, lora_delta_reference

__all__ = ["LoRALayerSlots", "LoRAStepMapping"]


@dataclass
class LoRAStepMapping:
    """Which tokens of the current step use which slot; shared by every wrapped layer and
    set by the manager before each forward (empty: no token has an adapter)."""

    groups: list[TokenGroup] = field(default_factory=list)


class LoRALayerSlots:
    """``max_loras`` slots of LoRA matrices for one linear layer; adds the delta of the
    step's adapters to the layer's output (``LinearBase.forward`` calls :meth:`add_delta`).

    Args:
        layer: the wrapped layer.
        max_loras: slots.
        max_rank: the largest rank a slot holds.
        mapping: the step's token groups (shared by all layers).
        device, dtype: of the slots (the model's).
    """

    def __init__(self, layer: LinearBase, max_loras: int, max_rank: int,
                 mapping: LoRAStepMapping, device: torch.device, dtype: torch.dtype) -> None:
        parts = len(layer.output_sizes)
        self.layer = layer
        self.max_rank = max_rank
        self.mapping = mapping
        self.lora_a = torch.zeros(max_loras, parts * max_rank, layer.input_size, device=device,
                                  dtype=dtype)
        self.lora_b = torch.zeros(max_loras, layer.output_size, parts * max_rank, device=device,
                                  dtype=dtype)
        # Whether the adapter in each slot adapts this layer (else its group is skipped).
        self.used = [False] * max_loras
        # The grouped shrink/expand: the Triton kernel where the platform lists Triton
        # kernels for this device, else the torch reference.
        self._delta = lora_delta_reference
        if choose_fused_op(device) == "triton":
            from inference_engine.lora.triton_grouped_matmul import lora_delta_triton

            self._delta = lora_delta_triton

    def load_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with ``part -> (A [r, K], B [rows, r] scaled)``; other parts zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offsets = [0]
        for size in self.layer.output_sizes:
            offsets.append(offsets[-1] + size)
        for part, (a, b) in parts.items():
            r = a.shape[0]
            cols = slice(part * self.max_rank, part * self.max_rank + r)
            self.lora_a[slot, cols].copy_(a)
            self.lora_b[slot, offsets[part]:offsets[part + 1], cols].copy_(b)
        self.used[slot] = bool(parts)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += scaling * x A^T B^T`` for each token's adapter; ``x [T, K]``,
        ``out [T, N]``."""
        groups = [g for g in self.mapping.groups if self.used[g.slot]]
        if not groups:
            return out
        x = x.reshape(-1, x.shape[-1])
        return self._delta(x, self.lora_a, self.lora_b, groups, out.view(-1, out.shape[-1]))
