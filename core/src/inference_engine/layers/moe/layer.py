"""The experts of one MoE layer: weights from the quant method, a GEMM kernel per platform.

``forward(x, weights, ids)`` runs every token through its chosen experts and
sums their outputs weighted by the router. The kernel is chosen once, when the
layer is built, from the platform's ``moe_kernels()`` list: the Triton grouped
GEMM (GPUs with Triton) or the torch path (sorted dispatch and grouped GEMMs).
Both are checked against the plain reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.moe.activation import SILU, ExpertActivation
from inference_engine.layers.moe.method import FusedMoEMethod, UnquantizedFusedMoEMethod
from inference_engine.layers.moe.torch_experts import fused_moe_torch

if TYPE_CHECKING:
    from inference_engine.interfaces.platform import Platform

__all__ = ["FusedMoE", "choose_moe_kernel"]

ExpertsFn = Callable[..., torch.Tensor]

# The kernels this module implements, by the names platforms list them under.
MOE_KERNELS = ("triton", "torch")


def _process_platform() -> Platform | None:
    """The process's platform (the engine's, else auto-selected); None when none is usable."""
    from inference_engine.platforms.selection import current_platform

    try:
        return current_platform()
    except (IndexError, LookupError, ValueError):  # no platform registered or present
        return None


def choose_moe_kernel(device: torch.device | None, platform: Platform | None) -> str:
    """The first of ``platform.moe_kernels()`` this module implements; ``"torch"`` when there
    is no platform or the weights live on another device type than the platform's."""
    if platform is None or device is None or torch.device(device).type != platform.device_type:
        return "torch"
    return next((k for k in platform.moe_kernels() if k in MOE_KERNELS), "torch")


def _experts_fn(kernel: str) -> ExpertsFn:
    if kernel == "triton":
        from inference_engine.layers.moe.triton_moe import fused_moe_triton

        return fused_moe_triton
    return fused_moe_torch


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
        platform: whose ``moe_kernels()`` to choose from; None: the process's current one.
    """

    def __init__(self, ctx: ModelContext, num_experts: int, hidden_size: int,
                 intermediate_size: int, prefix: str, activation: ExpertActivation = SILU,
                 bias: bool = False,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 checkpoint_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 platform: Platform | None = None,
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
        # The expert kernel, chosen once here (the hot path never probes the device).
        self.kernel = choose_moe_kernel(getattr(ctx, "device", None),
                                        platform or _process_platform())
        self._experts_fn: ExpertsFn = _experts_fn(self.kernel)

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
        gate_up, down, gate_up_bias, down_bias = self.quant_method.expert_weights(self)
        return self._experts_fn(x, gate_up, down, weights, ids, self.activation,
                                gate_up_bias, down_bias)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, activation={self.activation.name}, "
                f"method={type(self.quant_method).__name__}, kernel={self.kernel}")
