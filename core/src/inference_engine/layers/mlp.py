"""The gated SiLU MLP of Llama-family models, gate and up fused in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.linear import MergedColumnLinear, RowLinear

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    def __init__(self, ctx: ModelContext, hidden: int, intermediate: int, prefix: str,
                 act: str = "silu") -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {act!r} (only silu)")
        self.intermediate = intermediate
        self.gate_up_proj = MergedColumnLinear(ctx, hidden, [intermediate, intermediate],
                                               f"{prefix}.gate_up_proj")
        self.down_proj = RowLinear(ctx, intermediate, hidden, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
