"""The gated SiLU MLP of Llama-family models, gate and up fused in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.cpu_fused import fused_silu_and_mul
from inference_engine.layers.linear import MergedColumnLinear, RowLinear

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with ``gate_up_proj`` parts 0 (gate) and 1 (up).

    Args:
        ctx: the model context.
        hidden_size: model width.
        intermediate_size: width of gate and up each.
        prefix: dotted module name (``model.layers.0.mlp``).
        hidden_act: activation name from the config; only ``silu`` is implemented.
        bias: biases on all three projections (Llama's ``mlp_bias``).

    Raises:
        ValueError: for another activation.
    """

    def __init__(self, ctx: ModelContext, hidden_size: int, intermediate_size: int, prefix: str,
                 hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(
                f"{prefix}: unsupported hidden_act {hidden_act!r}; only 'silu' is implemented"
            )
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnLinear(ctx, hidden_size, [intermediate_size] * 2,
                                               f"{prefix}.gate_up_proj", bias=bias)
        self.down_proj = RowLinear(ctx, intermediate_size, hidden_size, f"{prefix}.down_proj",
                                   bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        gate_up = self.gate_up_proj(x)
        fused = fused_silu_and_mul(gate_up)
        if fused is not None:  # float32 on CPU: one call
            return self.down_proj(fused)
        gate, up = gate_up.chunk(2, dim=-1)
        # gate_up is a fresh buffer: activate the gate half in place.
        return self.down_proj(F.silu(gate, inplace=True) * up)
