"""FP8 experts of a fused-MoE layer: DeepSeek-style 128x128 blocks, per-tensor, or online.

Checkpoints store one tensor per expert and projection (``[out, in]``, or
``[in, out]`` with ``weight_layout: "KN"`` as ``inference-engine quantize`` writes
by default, scales transposed alike)
(``mlp.experts.{e}.gate_proj.weight`` F8_E4M3 ``[I, H]`` with
``weight_scale_inv`` ``[ceil(I/128), ceil(H/128)]`` for block checkpoints, or a
scalar ``weight_scale`` per tensor); they load into ``gate_up_proj [E, 2I, H]``
and ``down_proj [E, H, I]`` float8 and scale grids per part. After loading the
scales are expanded to one row per output channel (``[E, rows, ceil(cols/bk)]``,
about 3 % of the FP8 bytes for 128-wide K blocks) so gate and up parts whose
size is not a multiple of the block keep their own scales.

Online (``--quantization fp8`` / ``ptpc_fp8`` on a 16-bit MoE checkpoint) each
expert row gets its own scale (``amax / 448``), the PTPC weight scheme.

Forward runs :func:`~inference_engine_quant.quant_moe.fused_moe_quant`: the
Triton grouped GEMM converts the FP8 tiles in registers (weight-only: the
activations stay in the compute dtype, so static activation scales are not
used and are refused), the torch path dequantizes only the routed experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from inference_engine.layers.moe.method import (
    ExpertWeights,
    FusedMoEMethod,
    UnquantizedFusedMoEMethod,
    load_expert_part,
)
from torch import nn

from inference_engine_quant.fp8_math import quantize_weight_per_channel
from inference_engine_quant.mx_linear import replace_params
from inference_engine_quant.quant_moe import QuantExperts, dequantize_expert, fused_moe_quant

__all__ = ["Fp8FusedMoEMethod"]

# K extent meaning "one scale across all of K" (per-row / per-tensor scales).
_WHOLE_K = 1 << 30


def _load_fp8_part(intermediate: int, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: tuple[int, str] | None = None, *, name: str,
                   transposed: bool = False) -> None:
    if transposed and shard_id is not None:  # a KN checkpoint: each tensor is [in, out]
        loaded = loaded.t()
    if loaded.dtype == torch.uint8:
        loaded = loaded.view(torch.float8_e4m3fn)
    if loaded.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: expected an F8_E4M3 expert weight for an fp8 checkpoint, "
                         f"got {loaded.dtype}")
    load_expert_part(intermediate, param, loaded, shard_id, name=name)


def _load_scale(param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int, str],
                *, name: str, transposed: bool = False) -> None:
    """One expert part's scale (a block grid or a scalar) into its slot."""
    expert, part = shard_id
    if transposed and loaded.dim() == 2:
        loaded = loaded.t()
    target = param.data[expert]
    if part in ("gate", "up") and target.dim() > 0 and param.dim() > 1:
        target = target[0 if part == "gate" else 1]
    loaded = loaded.float()
    if target.numel() == 1 and loaded.numel() == 1:
        loaded = loaded.reshape(target.shape)
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch for {name} (expert {expert}, {part}): the checkpoint "
                         f"tensor has shape {tuple(loaded.shape)}, the model expects "
                         f"{tuple(target.shape)}")
    target.copy_(loaded)


class Fp8FusedMoEMethod(FusedMoEMethod):
    """FP8 experts kept in FP8 and multiplied through the quantized grouped GEMM."""

    format_name = "fp8"
    # Every parameter (block / per-tensor scales too) runs over experts first: whole experts
    # are placed over EP ranks.
    supports_expert_parallel = True

    def __init__(self, block_nk: tuple[int, int] | None, online: bool,
                 scale_name: str = "weight_scale_inv", dequantize_at_load: bool = False,
                 layout: str = "NK") -> None:
        if layout not in ("NK", "KN"):
            raise ValueError(f"FP8 expert weight layout must be NK or KN, got {layout!r}")
        self.transposed = layout == "KN"
        self.block_nk = block_nk
        self.online = online
        self.scale_name = scale_name if block_nk is not None else "weight_scale"
        self.dequantize_at_load = dequantize_at_load
        self._dense = UnquantizedFusedMoEMethod()

    def tensor_parallel_block(self) -> int | None:
        """Block scales' rows (gate/up) and columns (down) run along the intermediate width:
        a TP slice keeps whole blocks of both; per-tensor scales stay whole. Not for online
        quantization (down's per-row scales would be a slice's amax, not the row's) or KN
        checkpoints are cut on their own dimensions (``expert_part_dims``)."""
        if self.online:
            return None
        if self.block_nk is None:
            return 1
        return math.lcm(*self.block_nk)

    def create_weights(self, layer: nn.Module, prefix: str, num_experts: int, hidden_size: int,
                       intermediate_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        layer.fp8_params_dtype = params_dtype
        layer.fp8_dims = (hidden_size, intermediate_size)
        if self.online:
            self._dense.create_weights(layer, prefix, num_experts, hidden_size,
                                       intermediate_size, params_dtype, bias)
            return
        if bias:
            raise ValueError(f"{prefix}: FP8 experts with biases are not implemented")
        inter, hidden = intermediate_size, hidden_size
        for name, shape in (("gate_up_proj", (num_experts, 2 * inter, hidden)),
                            ("down_proj", (num_experts, hidden, inter))):
            param = nn.Parameter(torch.empty(shape, dtype=torch.float8_e4m3fn),
                                 requires_grad=False)
            param.weight_loader = partial(_load_fp8_part, inter,  # type: ignore[attr-defined]
                                          name=f"{prefix}.{name}", transposed=self.transposed)
            self._mark_part_dims(param)
            layer.register_parameter(name, param)
        if self.block_nk is None:
            shapes = {"gate_up_proj_scale": (num_experts, 2), "down_proj_scale": (num_experts,)}
        else:
            bn, bk = self.block_nk
            shapes = {"gate_up_proj_scale": (num_experts, 2, -(-inter // bn), -(-hidden // bk)),
                      "down_proj_scale": (num_experts, -(-hidden // bn), -(-inter // bk))}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
            param.weight_loader = partial(_load_scale,  # type: ignore[attr-defined]
                                          name=f"{prefix}.{name}", transposed=self.transposed)
            self._mark_part_dims(param)
            layer.register_parameter(name, param)

    def _mark_part_dims(self, param: nn.Parameter) -> None:
        """KN checkpoints store each expert's tensors (and block-scale grids) [in, out]: the
        intermediate width is their columns for gate/up and rows for down (TP cuts there)."""
        if self.transposed:
            param.expert_part_dims = {"gate": 1, "up": 1, "down": 0}  # type: ignore[attr-defined]

    def checkpoint_layouts(self, layer: nn.Module, leaf: str) -> list[dict[str, object]] | None:
        """Scales come one per expert and projection (``{e}.gate_proj.weight_scale_inv``)."""
        if leaf not in ("gate_up_proj_scale", "down_proj_scale"):
            return None
        gate, up, down = layer.expert_names
        parts = [(gate, "gate"), (up, "up")] if leaf == "gate_up_proj_scale" else [(down, "down")]
        return [{f"{e}.{name}.{self.scale_name}": (e, part)
                 for e in range(layer.num_experts) for name, part in parts}]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        hidden, inter = layer.fp8_dims
        if self.online:
            tensors: dict[str, torch.Tensor] = {}
            for part in ("gate_up", "down"):
                w = getattr(layer, f"{part}_proj").data
                q, s = quantize_weight_per_channel(w.reshape(-1, w.shape[-1]).float())
                tensors[f"{part}_proj"] = q.view(w.shape)
                tensors[f"{part}_proj_scale"] = s.view(*w.shape[:2], 1)
            bk = _WHOLE_K
        else:
            gu, dn = layer.gate_up_proj_scale.data, layer.down_proj_scale.data
            if torch.isnan(gu).any() or torch.isnan(dn).any():
                raise ValueError(f"{layer.prefix}: some expert scales were not in the checkpoint")
            num_experts = gu.shape[0]
            if self.block_nk is None:
                gu_rows = gu.repeat_interleave(inter, dim=1).reshape(num_experts, 2 * inter, 1)
                dn_rows = dn.reshape(num_experts, 1, 1).expand(num_experts, hidden, 1)
                bk = _WHOLE_K
            else:
                bn, bk = self.block_nk
                gu_rows = gu.repeat_interleave(bn, dim=2)[:, :, :inter].reshape(
                    num_experts, 2 * inter, -1)
                dn_rows = dn.repeat_interleave(bn, dim=1)[:, :hidden]
            tensors = {"gate_up_proj": layer.gate_up_proj.data, "down_proj": layer.down_proj.data,
                       "gate_up_proj_scale": gu_rows, "down_proj_scale": dn_rows}
        layer.fp8_block = (1, bk)
        if self.dequantize_at_load:
            experts = self._experts(layer, tensors)
            dense = {f"{part}_proj": torch.stack([
                dequantize_expert(experts, part, e, layer.fp8_params_dtype)
                for e in range(experts.gate_up.shape[0])]) for part in ("gate_up", "down")}
            replace_params(layer, ("gate_up_proj_scale", "down_proj_scale"), **dense)
            layer.fp8_dense = True
            return
        replace_params(layer, (), **{k: v.contiguous() for k, v in tensors.items()})
        layer.fp8_dense = False

    @staticmethod
    def _experts(layer: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> QuantExperts:
        t = tensors if tensors is not None else dict(layer.named_parameters(recurse=False))
        hidden, inter = layer.fp8_dims
        return QuantExperts("fp8", t["gate_up_proj"], t["gate_up_proj_scale"], t["down_proj"],
                            t["down_proj_scale"], hidden, inter, layer.fp8_block,
                            t.get("gate_up_proj_bias"), t.get("down_proj_bias"))

    def expert_weights(self, layer: nn.Module) -> ExpertWeights:
        """Dense experts (the whole layer: for callers that want it; forward does not)."""
        bias = (getattr(layer, "gate_up_proj_bias", None), getattr(layer, "down_proj_bias", None))
        if layer.fp8_dense:
            return (layer.gate_up_proj, layer.down_proj, *bias)
        experts = self._experts(layer)
        dense = [torch.stack([dequantize_expert(experts, part, e, layer.fp8_params_dtype)
                              for e in range(experts.gate_up.shape[0])])
                 for part in ("gate_up", "down")]
        return (dense[0], dense[1], *bias)

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              experts_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        if layer.fp8_dense:
            return super().apply(layer, x, weights, ids, experts_fn)
        return fused_moe_quant(layer.kernel, x, self._experts(layer), weights, ids,
                               layer.activation)

    def weight_memory_bytes(self, layer: nn.Module) -> int:
        """Bytes of the experts' FP8 weights and scales at rest (biases excluded)."""
        return sum(p.numel() * p.element_size() for name, p in layer.named_parameters(recurse=False)
                   if not name.endswith("_bias"))
