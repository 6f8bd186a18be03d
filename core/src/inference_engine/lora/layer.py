"""A linear layer's LoRA slots: the device copies of every loaded adapter's matrices for it.

A fused layer (q/k/v, gate/up) holds its parts' adapters side by side: part
``p`` uses ranks ``p*max_rank .. p*max_rank + r`` of ``lora_a`` and writes only
its own output rows through ``lora_b``, so the whole fused output gets its delta
from one shrink and one expand. The scaling is folded into ``lora_b`` on load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import LinearBase
from inference_engine.lora.grouped_matmul import StepSegments, lora_delta_reference

__all__ = ["LoRALayerSlots", "LoRAStepMapping"]


@dataclass
class LoRAStepMapping:
    """Which tokens of the current step use which slot; shared by every wrapped layer and
    set by the manager before each forward (None: no token has an adapter)."""

    segments: StepSegments | None = None


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
        # Whether the adapter in each slot adapts this layer (else the layer is skipped when
        # no slot of the step does).
        self.used = [False] * max_loras
        starts = [0]
        for size in layer.output_sizes:
            starts.append(starts[-1] + size)
        self.part_rows = list(zip(starts[:-1], starts[1:], strict=True))
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
        for part, (a, b) in parts.items():
            r = a.shape[0]
            n0, n1 = self.part_rows[part]
            cols = slice(part * self.max_rank, part * self.max_rank + r)
            self.lora_a[slot, cols].copy_(a)
            self.lora_b[slot, n0:n1, cols].copy_(b)
        self.used[slot] = bool(parts)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += scaling * x A^T B^T`` for each token's adapter; ``x [T, K]``,
        ``out [T, N]``."""
        seg = self.mapping.segments
        if seg is None or not any(self.used[slot] for slot in seg.slots):
            return out
        x = x.reshape(-1, x.shape[-1])
        return self._delta(x, self.lora_a, self.lora_b, seg, out.view(-1, out.shape[-1]))
