"""The gated SiLU MLP of Llama-family models, gate and up fused in one matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.cpu_fused import fused_silu_and_mul
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import MergedColumnLinear, RowLinear

__all__ = ["GatedMLP", "silu_and_mul_cpu", "silu_and_mul_impl", "silu_and_mul_torch"]


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
        # The activation's implementation, chosen once for the device the model is built on.
        self.fused_op = choose_fused_op(getattr(ctx, "device", None))
        self._silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_impl(
            self.fused_op)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        # gate_up is a fresh buffer, which the activation may overwrite.
        return self.down_proj(self._silu_and_mul(self.gate_up_proj(x)))


def silu_and_mul_torch(gate_up: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """The torch reference: ``silu(gate) * up`` for ``gate_up [T, 2N]`` (gate first) -> ``[T, N]``.

    Rounds as torch does in the dtype: the SiLU, then the product. ``inplace``
    activates the gate half of ``gate_up`` in place (for a buffer nobody else reads).
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=inplace) * up


def _silu_and_mul_fresh(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_torch(gate_up, inplace=True)


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul_torch` by the C++ kernel where it applies (float32 CPU), else torch
    (overwriting the gate half of ``gate_up``)."""
    fused = fused_silu_and_mul(gate_up)
    if fused is not None:  # float32 on CPU: one call
        return fused
    return silu_and_mul_torch(gate_up, inplace=True)


def silu_and_mul_impl(fused_op: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation of a :func:`~inference_engine.layers.fused_op_choice.choose_fused_op`
    answer; it may overwrite its (fresh) input."""
    if fused_op == "triton":
        from inference_engine.layers.triton_fused import silu_and_mul

        return silu_and_mul
    return silu_and_mul_cpu if fused_op == "cpu" else _silu_and_mul_fresh
