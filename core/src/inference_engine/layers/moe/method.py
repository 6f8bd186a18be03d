"""How a quantization method owns an MoE layer's expert weights.

:class:`~inference_engine.interfaces.quant.QuantMethod.fused_moe_method` hands
an MoE layer one of these (None: :class:`UnquantizedFusedMoEMethod`). The
method registers the checkpoint's expert tensors on the layer, converts them
after loading, and gives the expert GEMMs their weights as dense
``gate_up [E, 2I, K]`` / ``down [E, K_out, I]`` tensors in the compute dtype
(a quantized method may dequantize once after loading, or supply its own
kernel by overriding :meth:`FusedMoEMethod.apply`, as the FP8 and MXFP4
methods do to keep the experts quantized through the grouped GEMM).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

__all__ = ["ExpertWeights", "FusedMoEMethod", "UnquantizedFusedMoEMethod", "load_expert_part"]

# (gate_up [E, 2I, K], down [E, K_out, I], gate_up_bias [E, 2I] | None, down_bias [E, K_out] | None)
ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class FusedMoEMethod(ABC):
    """Creates, loads and presents one MoE layer's expert weights."""

    # Whether whole experts may be placed over expert-parallel ranks: every parameter's
    # first dimension runs over experts and per-expert checkpoint tensors load by
    # ``(expert, part)``, so the EP loader keeps the local experts' slices (scales too).
    supports_expert_parallel: bool = False

    def tensor_parallel_block(self) -> int | None:
        """The block of each expert's intermediate width that a tensor-parallel slice must
        keep whole (1: any cut), or None where these experts cannot be split across TP ranks.
        Their parameters are then cut like the unquantized ones, block-scaled tensors in
        whole blocks (``shard_expert_loader``)."""
        return None

    @abstractmethod
    def create_weights(self, layer: nn.Module, prefix: str, num_experts: int, hidden_size: int,
                       intermediate_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        """Register the expert parameters (with ``weight_loader``) on ``layer``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional
        """Convert loaded tensors to their runtime form."""

    @abstractmethod
    def expert_weights(self, layer: nn.Module) -> ExpertWeights:
        """Dense weights for the expert GEMMs."""

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              experts_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The experts of ``layer`` on ``x [T, hidden]`` routed by ``weights``/``ids [T, k]``.

        The default hands :meth:`expert_weights` to ``experts_fn`` (the layer's kernel,
        chosen at build, named by ``layer.kernel``); quantized methods override this to run
        their own grouped GEMM on the packed experts.
        """
        gate_up, down, gate_up_bias, down_bias = self.expert_weights(layer)
        return experts_fn(x, gate_up, down, weights, ids, layer.activation, gate_up_bias,
                          down_bias)

    def checkpoint_layouts(self, layer: nn.Module, leaf: str) -> list[dict[str, object]] | None:
        """Checkpoint names of the method's own parameter ``leaf`` (per-expert scales);
        None: the layer's default (a stacked tensor, or per expert for the weights)."""
        return None


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """Experts in the compute dtype: ``gate_up_proj [E, 2I, K]`` (``[E, I, K]`` for a
    non-gated activation), ``down_proj [E, K, I]``.

    Parameter names and layouts are transformers v5's, so a stacked tensor
    loads whole; per-expert checkpoint tensors load into one expert's rows
    through the part id ``(expert, "gate" | "up" | "down")``.
    """

    supports_expert_parallel = True

    def tensor_parallel_block(self) -> int | None:
        return 1

    def create_weights(self, layer: nn.Module, prefix: str, num_experts: int, hidden_size: int,
                       intermediate_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        # Gate and up rows, or up rows alone for a non-gated activation (Nemotron-H's relu²).
        gated = layer.activation.gated
        up_rows = layer.activation.up_rows(intermediate_size)
        shapes = {"gate_up_proj": (num_experts, up_rows, hidden_size),
                  "down_proj": (num_experts, hidden_size, intermediate_size)}
        if bias:
            shapes["gate_up_proj_bias"] = (num_experts, up_rows)
            shapes["down_proj_bias"] = (num_experts, hidden_size)
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            param.weight_loader = partial(  # type: ignore[attr-defined]
                load_expert_part, intermediate_size, name=f"{prefix}.{name}", gated=gated)
            layer.register_parameter(name, param)

    def expert_weights(self, layer: nn.Module) -> ExpertWeights:
        return (layer.gate_up_proj, layer.down_proj, getattr(layer, "gate_up_proj_bias", None),
                getattr(layer, "down_proj_bias", None))


def load_expert_part(intermediate_size: int, param: torch.Tensor, loaded: torch.Tensor,
                     shard_id: tuple[int, str] | None = None, *, name: str,
                     gated: bool = True) -> None:
    """Copy a stacked tensor whole, or one expert's gate/up/down part into its rows (a
    non-gated expert's up part fills all of its first projection).

    Raises:
        ValueError: naming the parameter, the part and both shapes on a mismatch.
    """
    target, where = param.data, name
    if shard_id is not None:
        expert, part = shard_id
        target = target[expert]
        if part in ("gate", "up") and gated:
            target = target.narrow(0, 0 if part == "gate" else intermediate_size,
                                   intermediate_size)
        where = f"{name} (expert {expert}, {part})"
    if target.shape != loaded.shape:
        raise ValueError(f"shape mismatch for {where}: the checkpoint tensor has shape "
                         f"{tuple(loaded.shape)}, the model expects {tuple(target.shape)}")
    target.copy_(loaded)
