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

from inference_engine.distributed.collectives import SINGLE_RANK, GroupCollectives
from inference_engine.distributed.parallel_state import parallel_state
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.moe.activation import SILU, ExpertActivation
from inference_engine.layers.moe.dispatch import expert_counts
from inference_engine.layers.moe.expert_parallel import (
    ExpertPlacement,
    allgather_reducescatter_experts,
    alltoall_experts,
)
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


def shard_expert_loader(loader: Callable[..., None], name: str, placement: ExpertPlacement,
                        tp: GroupCollectives, intermediate_size: int,
                        gated: bool = True,
                        part_dims: dict[str, int] | None = None) -> Callable[..., None]:
    """``loader`` fed this rank's part of full checkpoint tensors: only the local experts
    (expert parallelism; a remote expert's tensor is skipped), and under tensor parallelism
    only this rank's slice of each expert's intermediate width (gate and up alike; the down
    bias kept by TP rank 0 alone, as it is added before the all-reduce). ``part_dims``: the
    intermediate dimension of a per-expert gate / up / down tensor (default 0, 0, 1; a
    parameter's ``expert_part_dims`` says otherwise, e.g. checkpoints stored [in, out])."""
    inter, rank, size = intermediate_size, tp.rank, tp.size
    dims = part_dims or {"gate": 0, "up": 0, "down": 1}
    part = inter // size

    def slice_of(t: torch.Tensor, dim: int, full: int, offset: int) -> torch.Tensor:
        """This rank's ``part`` of ``full`` intermediate entries along ``dim`` starting at
        ``offset``; a tensor holding one entry per block of them (quantized experts' block
        scales, packed MXFP4 blocks) is cut in whole blocks."""
        extent = t.shape[dim]
        unit = 1 if extent == full else (full // extent if extent and full % extent == 0 else 0)
        if not unit or part % unit or offset % unit:
            raise ValueError(f"{name}: a tensor of {extent} entries over {full} intermediate "
                             f"values cannot be split into {size} slices of {part} without "
                             f"cutting a block (tensor_parallel_size {size})")
        return t.narrow(dim, (offset + rank * part) // unit, part // unit)

    def tp_rows(t: torch.Tensor, dim: int, gate_up: bool) -> torch.Tensor:
        if size == 1:
            return t
        if gate_up and gated:
            halves = t.chunk(2, dim=dim)
            return torch.cat([slice_of(h, dim, inter, 0) for h in halves], dim=dim)
        return slice_of(t, dim, inter, 0)

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:  # one expert's gate / up / down (weight or scale)
            expert, which = shard_id  # type: ignore[misc]
            local = placement.local_index(int(expert))
            if local is None:
                return
            if size > 1 and loaded.numel() > 1:  # per-tensor scales stay whole
                loaded = slice_of(loaded, dims[which], inter, 0)
            loader(param, loaded, (local, which))
            return
        # A stacked [E, ...] tensor: this rank's experts, then its intermediate slice.
        loaded = loaded.narrow(0, placement.start, placement.num_local)
        if name == "down_proj_bias":
            if rank > 0:
                loaded = torch.zeros_like(loaded)
        elif name.startswith("gate_up_proj"):  # weights, biases, blocks, scales: [E, 2I, ...]
            loaded = tp_rows(loaded, 1, True)
        elif name.startswith("down_proj"):  # [E, out, I...]: I (or its blocks) on dim 2
            loaded = tp_rows(loaded, 2, False)
        loader(param, loaded)

    return load


class FusedMoE(nn.Module):
    """``num_experts`` MLPs (``hidden -> 2 * intermediate -> hidden`` gated, or
    ``hidden -> intermediate -> hidden``) applied by routing.

    Args:
        ctx: the model context (dtype, quant method).
        num_experts: experts in the layer.
        hidden_size: model width (K and the output width).
        intermediate_size: each expert's gate/up width.
        prefix: dotted module name (``model.layers.0.mlp.experts``).
        activation: the activation between the GEMMs (gated, or not: then the first
            projection holds the up rows alone, ``[E, I, K]``).
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
        if not activation.gated and type(self.quant_method) is not UnquantizedFusedMoEMethod:
            raise ValueError(f"{prefix}: quantized experts ({type(self.quant_method).__name__}) "
                             f"with the non-gated {activation.name!r} activation are not "
                             f"implemented")
        # Parallelism, fixed at build: experts placed over the EP ranks (whole experts), or
        # under tensor parallelism each expert's intermediate width split like an MLP's.
        ps = parallel_state()
        self.placement = ExpertPlacement(num_experts, ps.ep.size, ps.ep.rank)
        self._ep, self._tp = ps.ep, (ps.tp if ps.ep.size == 1 else SINGLE_RANK)
        # Expert parallel: the ranks holding the same tokens (TP) and those holding others (DP).
        self._token_group, self._dp = ps.tp, ps.dp
        self.all2all_backend = ps.all2all_backend
        if self._tp.size > 1 and intermediate_size % self._tp.size:
            raise ValueError(f"{prefix}: expert intermediate size ({intermediate_size}) is not "
                             f"divisible by tensor_parallel_size ({self._tp.size})")
        self.local_intermediate = intermediate_size // self._tp.size
        self.register_buffer("global_to_local", self.placement.global_to_local(),
                             persistent=False)
        # Assignments routed to each expert (every rank counts all of them), when parallel:
        # the load a future expert balancer reads (exported in /metrics).
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)
        self.counts_load = ps.ep.size > 1 or self._tp.size > 1
        self.quant_method.create_weights(self, prefix, self.placement.num_local, hidden_size,
                                         self.local_intermediate, ctx.dtype, bias)
        if self._ep.size > 1 or self._tp.size > 1:
            quantized = type(self.quant_method) is not UnquantizedFusedMoEMethod
            method_name = type(self.quant_method).__name__
            block = self.quant_method.tensor_parallel_block()
            if quantized and self._tp.size > 1 and block is None:
                hint = ("; --enable-expert-parallel places whole experts instead"
                        if self.quant_method.supports_expert_parallel else "")
                raise ValueError(f"{prefix}: tensor parallelism of quantized experts "
                                 f"({method_name}) is not implemented{hint}")
            if self._tp.size > 1 and block is not None and self.local_intermediate % block:
                raise ValueError(f"{prefix}: {method_name} experts keep blocks of {block} "
                                 f"intermediate values whole, but tensor_parallel_size "
                                 f"{self._tp.size} gives each rank {self.local_intermediate} "
                                 f"of {intermediate_size}, which would cut a block")
            if not self.quant_method.supports_expert_parallel:
                raise ValueError(f"{prefix}: expert parallelism of quantized experts "
                                 f"({method_name}) is not implemented")
            for name, param in self.named_parameters(recurse=False):
                param.weight_loader = shard_expert_loader(  # type: ignore[attr-defined]
                    param.weight_loader, name, self.placement, self._tp, intermediate_size,
                    activation.gated, getattr(param, "expert_part_dims", None))
        if checkpoint_transform is not None:
            for name, param in self.named_parameters(recurse=False):
                param.weight_loader = _transformed(  # type: ignore[attr-defined]
                    param.weight_loader, name, checkpoint_transform)
        # The expert kernel, chosen once here (the hot path never probes the device).
        self.kernel = choose_moe_kernel(getattr(ctx, "device", None),
                                        platform or _process_platform())
        self._experts_fn: ExpertsFn = _experts_fn(self.kernel)

    def checkpoint_layouts(self, leaf: str) -> list[dict[str, object]]:
        """A stacked ``leaf`` tensor, or (for the weights) one tensor per expert and part;
        the quant method names its own parameters' layouts (per-expert scales) first."""
        own = self.quant_method.checkpoint_layouts(self, leaf)
        if own is not None:
            return own
        gate, up, down = self.expert_names
        # A non-gated expert's first projection is its up projection alone (stacked or not).
        stacked = up if leaf == "gate_up_proj" and not self.activation.gated else leaf
        layouts: list[dict[str, object]] = [{stacked: None}]
        first = [(gate, "gate"), (up, "up")] if self.activation.gated else [(up, "up")]
        per_expert = {"gate_up_proj": first, "down_proj": [(down, "down")]}
        if leaf in per_expert:
            layouts.insert(0, {f"{e}.{name}.weight": (e, part)
                               for e in range(self.num_experts)
                               for name, part in per_expert[leaf]})
        return layouts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, router ``weights``/``ids [T, k]`` -> ``[T, hidden]``."""
        if self._ep.size == 1 and self._tp.size == 1:
            return self.quant_method.apply(self, x, weights, ids, self._experts_fn)
        self.expert_load += expert_counts(ids.reshape(-1), self.num_experts)
        if self._ep.size == 1:  # tensor parallel: partial sums of every expert's slice
            out = self.quant_method.apply(self, x, weights, ids, self._experts_fn)
            return self._tp.all_reduce(out)

        def local(xs: torch.Tensor, ws: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return self.quant_method.apply(self, xs, ws, local_ids, self._experts_fn)

        if self.all2all_backend == "alltoall":
            return alltoall_experts(x, weights, ids, self.placement, self.global_to_local,
                                    local, self._ep, self._token_group)
        return allgather_reducescatter_experts(x, weights, ids, self.placement,
                                               self.global_to_local, local, self._ep, self._dp)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, activation={self.activation.name}, "
                f"method={type(self.quant_method).__name__}, kernel={self.kernel}")
