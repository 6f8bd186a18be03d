"""The experts of one MoE layer: weights from the quant method, a GEMM backend per device.

``forward(x, weights, ids)`` runs every token through its chosen experts and
sums their outputs weighted by the router. On CUDA the Triton grouped GEMM
runs; elsewhere the torch path (sorted dispatch, one matmul pair per expert
that received tokens). Both are checked against the plain reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.moe.activation import SILU, ExpertActivation
from inference_engine.layers.moe.method import FusedMoEMethod, UnquantizedFusedMoEMethod
from inference_engine.layers.moe.torch_experts import fused_moe_torch

__all__ = ["FusedMoE"]

ExpertsFn = Callable[..., torch.Tensor]


def _triton_experts() -> ExpertsFn:
    from inference_engine.layers.moe.triton_moe import fused_moe_triton

    return fused_moe_triton


def _transformed(loader: Callable[..., None], name: str,
                 transform: Callable[[str, torch.Tensor], torch.Tensor]) -> Callable[..., None]:
    """``loader`` that converts a stacked (whole-parameter) tensor first."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            loader(param, transform(name, loaded))
        else:
            loader(param, loaded, shard_id)

    return load


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs (``hidden -> 2 * intermediate -> hidden``) applied by routing.

    Args:
        ctx: the model context (dtype, quant method).
        num_experts: experts in the layer.
        hidden_size: model width (K and the output width).
        intermediate_size: each expert's gate/up width.
        prefix: dotted module name (``model.layers.0.mlp.experts``).
        activation: the gated activation between the GEMMs.
        bias: biases on both expert projections (gpt-oss).
        expert_names: per-expert checkpoint module names of (gate, up, down):
            ``("gate_proj", "up_proj", "down_proj")`` or Mixtral's ``("w1", "w3", "w2")``.
        checkpoint_transform: ``(parameter name, stacked checkpoint tensor) -> tensor`` in
            our layout, for checkpoints that stack experts differently (gpt-oss).
    """

    def __init__(self, ctx: ModelContext, num_experts: int, hidden_size: int,
                 intermediate_size: int, prefix: str, activation: ExpertActivation = SILU,
                 bias: bool = False,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 checkpoint_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 ) -> None:
        super().__init__()
        self.prefix = prefix
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.expert_names = expert_names
        # Named like linear layers' attribute, so the loader's process-after-loading pass finds it.
        self.quant_method: FusedMoEMethod = (
            ctx.quant_method.fused_moe_method(prefix) or UnquantizedFusedMoEMethod())
        self.quant_method.create_weights(self, prefix, num_experts, hidden_size,
                                         intermediate_size, ctx.dtype, bias)
        if checkpoint_transform is not None:
            for name, param in self.named_parameters(recurse=False):
                param.weight_loader = _transformed(  # type: ignore[attr-defined]
                    param.weight_loader, name, checkpoint_transform)
        self._experts_fn: ExpertsFn | None = None

    def checkpoint_layouts(self, leaf: str) -> list[dict[str, object]]:
        """A stacked ``leaf`` tensor, or (for the weights) one tensor per expert and part."""
        layouts: list[dict[str, object]] = [{leaf: None}]
        gate, up, down = self.expert_names
        per_expert = {"gate_up_proj": [(gate, "gate"), (up, "up")], "down_proj": [(down, "down")]}
        if leaf in per_expert:
            layouts.insert(0, {f"{e}.{name}.weight": (e, part)
                               for e in range(self.num_experts)
                               for name, part in per_expert[leaf]})
        return layouts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, router ``weights``/``ids [T, k]`` -> ``[T, hidden]``."""
        if self._experts_fn is None:
            self._experts_fn = _triton_experts() if x.is_cuda else fused_moe_torch
        gate_up, down, gate_up_bias, down_bias = self.quant_method.expert_weights(self)
        return self._experts_fn(x, gate_up, down, weights, ids, self.activation,
                                gate_up_bias, down_bias)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, activation={self.activation.name}, "
                f"method={type(self.quant_method).__name__}")
