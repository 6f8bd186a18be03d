"""A sparse MoE block as decoder layers use it: router, routed experts, shared experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.linear import ReplicatedLinear
from inference_engine.layers.mlp import GatedMLP
from inference_engine.layers.moe.activation import SILU, ExpertActivation
from inference_engine.layers.moe.layer import FusedMoE
from inference_engine.layers.moe.router import RouterSpec, route

__all__ = ["SparseMoeBlock"]


class SparseMoeBlock(nn.Module):
    """``experts(x, route(gate(x))) + shared_experts(x)``.

    Module names follow transformers (``gate``, ``experts``, ``shared_experts``)
    so checkpoint names map directly.

    Args:
        ctx: the model context.
        hidden_size: model width.
        intermediate_size: each routed expert's width.
        router: the routing rules.
        prefix: dotted module name (``model.layers.3.mlp``).
        gate_name: the router projection's module name (``gate``; gpt-oss: ``router``).
        gate_bias: a bias on the router projection (gpt-oss).
        correction_bias: where ``e_score_correction_bias`` lives: on the ``"gate"``
            (DeepSeek-V3, GLM-4-MoE), on the ``"block"`` (MiniMax-M2), or None.
        shared_intermediate_size: width of the always-on shared experts (0: none).
        activation, expert_bias, expert_names, checkpoint_transform: passed to
            :class:`FusedMoE`.
    """

    def __init__(self, ctx: ModelContext, hidden_size: int, intermediate_size: int,
                 router: RouterSpec, prefix: str, *, gate_name: str = "gate",
                 gate_bias: bool = False, correction_bias: str | None = None,
                 shared_intermediate_size: int = 0, activation: ExpertActivation = SILU,
                 expert_bias: bool = False,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 checkpoint_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 ) -> None:
        super().__init__()
        if correction_bias not in (None, "gate", "block"):
            raise ValueError(f"{prefix}: correction_bias must be None, 'gate' or 'block'")
        self.routing = router
        self.gate_name = gate_name
        gate = ReplicatedLinear(ctx, hidden_size, router.num_experts, f"{prefix}.{gate_name}",
                                bias=gate_bias)
        self.add_module(gate_name, gate)
        self._gate = [gate]  # a plain list: reach the gate without nn.Module attribute lookup
        self.experts = FusedMoE(ctx, router.num_experts, hidden_size, intermediate_size,
                                f"{prefix}.experts", activation, expert_bias, expert_names,
                                checkpoint_transform)
        bias = None
        if correction_bias is not None:
            bias = nn.Parameter(torch.zeros(router.num_experts, dtype=torch.float32),
                                requires_grad=False)
            owner = gate if correction_bias == "gate" else self
            owner.register_parameter("e_score_correction_bias", bias)
        self._correction_bias = [bias]  # registered once, on its owner above
        self.shared_experts = (
            GatedMLP(ctx, hidden_size, shared_intermediate_size, f"{prefix}.shared_experts")
            if shared_intermediate_size else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        weights, ids = route(self._gate[0](x), self.routing, self._correction_bias[0])
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
