"""The compressed-tensors schemes we load, one :class:`LinearFormat` each.

* :class:`CtPackedIntFormat`: ``pack-quantized`` W4A16 / W8A16 (``weights``
  int 4/8 bits, group or channel strategy, symmetric or not, no activation
  quantization). Tensors: ``weight_packed [N, ceil(K*bits/32)]`` int32 (the
  library's ``pack_to_int32``: value ``i`` of a row at bit ``i*bits``, each
  value offset by ``2^(bits-1)`` to be unsigned), ``weight_scale [N, G]``,
  ``weight_shape [2]``, ``weight_zero_point [ceil(N/pack), G]`` int32 when
  asymmetric (packed along N, offset the same way), ``weight_g_idx [K]`` with
  activation ordering. ``W = (q - z) * s``; symmetric: ``z = 2^(bits-1)``.
* :class:`CtFp8Format`: ``float-quantized`` FP8 with ``tensor`` or ``channel``
  weight scales (``weight_scale [1]`` / ``[N, 1]``), activations dynamic per
  token, static per tensor (``input_scale``) or none (weight-only); runs on
  the FP8 linear of :mod:`fp8_linear`.
* FP8 ``block`` (``weight_scale [ceil(N/bn), ceil(K/bk)]``, activations
  dynamic per token and ``bk`` group): the ``fp8`` method's block path.
* :class:`CtInt8Format`: ``int-quantized`` INT8 W8A8 (channel or tensor int8
  weights, dynamic per-token int8 activations): :mod:`int8_w8a8`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from inference_engine.layers.linear import copy_into_rows
from torch import nn

from inference_engine_quant.fp8 import Fp8Method
from inference_engine_quant.fp8_linear import apply_fp8_linear, finalize_fp8_layer
from inference_engine_quant.int8_w8a8 import apply_int8_w8a8, finalize_int8_w8a8
from inference_engine_quant.int_packing import pack_along, pack_factor, unpack_along
from inference_engine_quant.int_weight_only import (
    add_g_idx_param,
    apply_int_weight_only,
    finalize_int_weight_only,
    loaded_g_idx,
)
from inference_engine_quant.mx_linear import (
    LinearFormat,
    add_part_scalar_param,
    rows_from_parts,
)

__all__ = ["CtFp8BlockFormat", "CtFp8Format", "CtInt8Format", "CtPackedIntFormat"]


def _load_rows_as(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                  shard_id: int | str | None = None, *, name: str, kinds: tuple[torch.dtype, ...],
                  ) -> None:
    """Copy a row-major tensor (whole or one fused part) whose dtype is one of ``kinds``."""
    if loaded.dtype not in kinds:
        allowed = ", ".join(str(k).removeprefix("torch.") for k in kinds)
        raise ValueError(f"{name}: expected {allowed}, the checkpoint tensor is {loaded.dtype}")
    copy_into_rows(layer, param, loaded.to(param.dtype), shard_id, name)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _add_rows(layer: nn.Module, prefix: str, name: str, shape: tuple[int, ...],
              dtype: torch.dtype, kinds: tuple[torch.dtype, ...]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = partial(_load_rows_as, layer, name=f"{prefix}.{name}", kinds=kinds)  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def _load_packed_rows(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | str | None = None, *, name: str, pack: int) -> None:
    """Zero points packed along N (dim 0): a fused part fills ``size / pack`` word rows."""
    target = param.data
    where = name
    if shard_id is not None:
        offset, size = layer.shard_rows(shard_id)
        if offset % pack or size % pack:
            raise ValueError(f"{name}: part {shard_id!r} ({size} rows at {offset}) does not "
                             f"split into packed words of {pack} rows")
        target = target.narrow(0, offset // pack, size // pack)
        where = f"{name} (part {shard_id!r})"
    if tuple(target.shape) != tuple(loaded.shape) or loaded.dtype != torch.int32:
        raise ValueError(f"mismatch for {where}: the checkpoint tensor is {loaded.dtype} "
                         f"{tuple(loaded.shape)}, the model expects int32 {tuple(target.shape)}")
    target.copy_(loaded)


def _load_shape(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                shard_id: int | str | None = None, *, name: str) -> None:
    row = 0 if shard_id is None else layer.shard_ids.index(shard_id)
    if loaded.numel() != 2:
        raise ValueError(f"{name}: expected the two-element original shape, got "
                         f"{tuple(loaded.shape)}")
    param.data[row].copy_(loaded.reshape(2).to(torch.int64))


class CtPackedIntFormat(LinearFormat):
    """``pack-quantized`` int4/int8 weights (W4A16, W8A16), group or channel scales."""

    name = "int_weight_only"

    def __init__(self, weights: dict[str, Any], platform: Any, dequantize_at_load: bool) -> None:
        self.bits = int(weights.get("num_bits", 4))
        pack_factor(self.bits)
        self.strategy = str(weights.get("strategy"))
        if self.strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors pack-quantized with strategy "
                             f"{self.strategy!r} is not supported (group, channel)")
        self.group_size = int(weights.get("group_size") or 0)
        if self.strategy == "group" and self.group_size <= 0:
            raise ValueError("compressed-tensors group strategy needs a positive group_size")
        self.symmetric = bool(weights.get("symmetric", True))
        self.platform = platform
        self.dequantize_at_load = dequantize_at_load

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        pack = pack_factor(self.bits)
        k, n = input_size, sum(output_sizes)
        if k % pack:
            raise ValueError(f"{prefix}: input size {k} is not a multiple of {pack}")
        group = k if self.strategy == "channel" else self.group_size
        if k % group:
            raise ValueError(f"{prefix}: input size {k} is not a multiple of the group size "
                             f"{group}")
        groups = k // group
        layer.ct_group_size = group
        layer.ct_params_dtype = params_dtype
        _add_rows(layer, prefix, "weight_packed", (n, k // pack), torch.int32, (torch.int32,))
        _add_rows(layer, prefix, "weight_scale", (n, groups), torch.float32, _FLOATS)
        shape = nn.Parameter(torch.zeros(len(output_sizes), 2, dtype=torch.int64),
                             requires_grad=False)
        shape.weight_loader = partial(_load_shape, layer, name=f"{prefix}.weight_shape")  # type: ignore[attr-defined]
        layer.register_parameter("weight_shape", shape)
        if not self.symmetric:
            zp = nn.Parameter(torch.empty(-(-n // pack), groups, dtype=torch.int32),
                              requires_grad=False)
            zp.weight_loader = partial(_load_packed_rows, layer,  # type: ignore[attr-defined]
                                       name=f"{prefix}.weight_zero_point", pack=pack)
            layer.register_parameter("weight_zero_point", zp)
        add_g_idx_param(layer, prefix, "weight_g_idx", k, optional=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        k = layer.input_size
        for part, (rows, cols) in zip(layer.shard_ids, layer.weight_shape.tolist(), strict=True):
            _, size = layer.shard_rows(part)
            if (rows, cols) != (size, k):
                raise ValueError(f"{layer.prefix}: weight_shape of part {part!r} is "
                                 f"{[rows, cols]}, the model expects {[size, k]}")
        q = unpack_along(layer.weight_packed.data, self.bits, dim=1)  # [N, K] unsigned
        n = q.shape[0]
        groups = layer.weight_scale.shape[1]
        if self.symmetric:
            zeros = torch.full((groups, n), float(1 << (self.bits - 1)), device=q.device)
        else:
            zeros = unpack_along(layer.weight_zero_point.data, self.bits, dim=0)[:n].t().float()
        g_idx = loaded_g_idx(layer, "weight_g_idx", layer.ct_group_size, groups)
        finalize_int_weight_only(
            layer, pack_along(q.t(), self.bits, dim=0), layer.weight_scale.data.t(), zeros,
            g_idx, self.bits, self.platform, layer.ct_params_dtype, self.dequantize_at_load,
            ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
             "weight_g_idx"),
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_int_weight_only(layer, x, bias)


class CtFp8Format(LinearFormat):
    """``float-quantized`` FP8 weights with per-tensor or per-channel scales."""

    name = "fp8"

    def __init__(self, strategy: str, activations: dict[str, Any] | None, platform: Any,
                 dequantize_at_load: bool) -> None:
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"FP8 weight strategy {strategy!r} handled elsewhere")
        self.strategy = strategy
        self.static_input = activations is not None and not activations.get("dynamic", False)
        if self.static_input and activations.get("strategy") != "tensor":
            raise ValueError(f"static FP8 activations with strategy "
                             f"{activations.get('strategy')!r} are not supported (tensor only)")
        if activations is not None and activations.get("dynamic") and \
                activations.get("strategy") not in ("token", "tensor"):
            raise ValueError(f"dynamic FP8 activations with strategy "
                             f"{activations.get('strategy')!r} are not supported (token)")
        self.act_quant = activations is not None
        self.platform = platform
        self.dequantize_at_load = dequantize_at_load

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        n, k = sum(output_sizes), input_size
        layer.ct_params_dtype = params_dtype
        _add_rows(layer, prefix, "weight", (n, k), torch.float8_e4m3fn, (torch.float8_e4m3fn,))
        if self.strategy == "tensor":
            add_part_scalar_param(layer, prefix, "weight_scale")
        else:
            _add_rows(layer, prefix, "weight_scale", (n, 1), torch.float32, _FLOATS)
        if self.static_input:
            add_part_scalar_param(layer, prefix, "input_scale")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        if self.strategy == "tensor":
            scale = rows_from_parts(layer, layer.weight_scale.data)
        else:
            scale = layer.weight_scale.data.reshape(-1)
        input_scale = layer.input_scale.data.max() if self.static_input else None
        finalize_fp8_layer(
            layer, weight.t(), scale.reshape(1, -1), (weight.shape[1], 1), input_scale,
            act_quant=self.act_quant, platform=self.platform,
            compute_dtype=layer.ct_params_dtype, dequantize_at_load=self.dequantize_at_load,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_fp8_linear(layer, x, bias)


class _BlockScaleNamedWeightScale(Fp8Method):
    """The ``fp8`` block path with the block scale named as compressed-tensors names it."""

    block_scale_name = "weight_scale"


class CtFp8BlockFormat(LinearFormat):
    """``float-quantized`` FP8 with ``block`` weight scales, dynamic per-token-group activations."""

    name = "fp8"

    def __init__(self, block: list[int], options: dict[str, Any]) -> None:
        if len(block) != 2:
            raise ValueError(f"block_structure must be [rows, cols], got {block!r}")
        self._method = _BlockScaleNamedWeightScale(
            {"quant_method": "fp8", "weight_block_size": [int(b) for b in block],
             "activation_scheme": "dynamic"}, **options)

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        self._method.create_weights(layer, prefix, input_size, output_sizes, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._method.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._method.apply(layer, x, bias)


class CtInt8Format(LinearFormat):
    """``int-quantized`` INT8 W8A8: int8 weights per channel/tensor, int8 activations per token."""

    name = "int8_w8a8"

    def __init__(self, strategy: str, platform: Any) -> None:
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"INT8 W8A8 weight strategy {strategy!r} is not supported "
                             f"(channel, tensor)")
        self.strategy = strategy
        self.platform = platform

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        n, k = sum(output_sizes), input_size
        _add_rows(layer, prefix, "weight", (n, k), torch.int8, (torch.int8,))
        if self.strategy == "tensor":
            add_part_scalar_param(layer, prefix, "weight_scale")
        else:
            _add_rows(layer, prefix, "weight_scale", (n, 1), torch.float32, _FLOATS)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.strategy == "tensor":
            scale = rows_from_parts(layer, layer.weight_scale.data)
        else:
            scale = layer.weight_scale.data.reshape(-1)
        finalize_int8_w8a8(layer, layer.weight.data, scale, self.platform,
                           ("weight", "weight_scale"))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_int8_w8a8(layer, x, bias)
