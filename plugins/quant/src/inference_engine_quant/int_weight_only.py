"""Runtime integer weight-only linear (W4A16 / W8A16): one form for AWQ, GPTQ, compressed-tensors.

Each method loads its checkpoint's tensors, converts them (:mod:`int_packing`)
and ends with :func:`finalize_int_weight_only`, which leaves on the layer the
form :mod:`~inference_engine_quant.kernels.int_weight_only_gemm` reads
(``qweight [K/pack, N]`` int32, ``scales``/``zeros [G, N]``, ``g_idx [K]``) and
the kernel chosen once for the platform (:func:`choose_int_weight_only_kernel`):
the Triton GEMM where ``platform.int_gemm_kernels()`` lists it, else the torch
reference; ``--dequantize-at-load`` keeps a dense copy instead (reference only).

The checkpoints here store fused layers' parts (q/k/v, gate/up) as separate
tensors packed or laid out along N, so their loaders place each part by
*columns* (:func:`add_column_param`), unlike the row-major formats of
:mod:`mx_linear`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from inference_engine.interfaces.platform import KERNEL_TRITON_INT_WEIGHT_ONLY
from torch import nn

from inference_engine_quant.kernels.int_weight_only_gemm import (
    HAS_TRITON,
    int_weight_only_reference,
    int_weight_only_triton,
)
from inference_engine_quant.mx_linear import replace_params, set_dense_weight

__all__ = [
    "INT_KERNEL_NAMES",
    "add_column_param",
    "add_g_idx_param",
    "apply_int_weight_only",
    "choose_int_weight_only_kernel",
    "finalize_int_weight_only",
    "int_weight_only_kernel_name",
    "loaded_g_idx",
]

logger = logging.getLogger(__name__)

INT_KERNEL_NAMES: dict[str, str] = {
    "reference": "torch int4/int8 dequantize + matmul (reference)",
    "triton": "triton int4/int8 weight-only GEMM (dequantize in kernel, 16-bit activations)",
}


def choose_int_weight_only_kernel(platform: Any) -> str:
    """``"triton"`` where the platform lists the Triton weight-only GEMM, else ``"reference"``."""
    listed = getattr(platform, "int_gemm_kernels", None) if platform is not None else None
    if HAS_TRITON and listed is not None and KERNEL_TRITON_INT_WEIGHT_ONLY in listed():
        return "triton"
    return "reference"


def int_weight_only_kernel_name(platform: Any) -> str:
    """Human name of the weight-only path on ``platform`` (``inference-engine env``)."""
    return INT_KERNEL_NAMES[choose_int_weight_only_kernel(platform)]


def _load_columns(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                  shard_id: int | str | None = None, *, name: str,
                  columns_per_entry: int) -> None:
    """Copy a tensor laid out along N in dim 1 (whole, or one fused part's columns).

    ``columns_per_entry`` is how many output columns one stored entry covers
    (1 for scales, ``pack`` for tensors packed along N).
    """
    target = param.data
    where = name
    if shard_id is not None:
        offset, size = layer.shard_rows(shard_id)
        if offset % columns_per_entry or size % columns_per_entry:
            raise ValueError(f"{name}: part {shard_id!r} of {size} columns at {offset} does not "
                             f"split into packed words of {columns_per_entry}")
        target = target.narrow(1, offset // columns_per_entry, size // columns_per_entry)
        where = f"{name} (part {shard_id!r})"
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch for {where}: the checkpoint tensor has shape "
                         f"{tuple(loaded.shape)}, the model expects {tuple(target.shape)}")
    if param.dtype == torch.int32 and loaded.dtype != torch.int32:
        raise ValueError(f"{where}: expected packed int32 words, the checkpoint tensor is "
                         f"{loaded.dtype}")
    target.copy_(loaded)


def add_column_param(layer: nn.Module, prefix: str, name: str, shape: tuple[int, int],
                     dtype: torch.dtype, columns_per_entry: int = 1) -> nn.Parameter:
    """Register a ``[rows, N / columns_per_entry]`` parameter loaded by columns per fused part."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = partial(_load_columns, layer, name=f"{prefix}.{name}",  # type: ignore[attr-defined]
                                  columns_per_entry=columns_per_entry)
    layer.register_parameter(name, param)
    return param


def _load_g_idx(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                shard_id: int | str | None = None, *, name: str) -> None:
    """One ``[K]`` row per fused part (they share the input, so they should agree)."""
    if loaded.dim() != 1 or loaded.shape[0] != param.shape[1]:
        raise ValueError(f"shape mismatch for {name}: the checkpoint tensor has shape "
                         f"{tuple(loaded.shape)}, the model expects ({param.shape[1]},)")
    row = 0 if shard_id is None else layer.shard_ids.index(shard_id)
    param.data[row].copy_(loaded.to(torch.int32))


def add_g_idx_param(layer: nn.Module, prefix: str, name: str, k: int,
                    optional: bool) -> nn.Parameter:
    """Register ``[num_parts, K]`` int32 group indices, -1 until loaded."""
    param = nn.Parameter(torch.full((len(layer.output_sizes), k), -1, dtype=torch.int32),
                         requires_grad=False)
    param.weight_loader = partial(_load_g_idx, layer, name=f"{prefix}.{name}")  # type: ignore[attr-defined]
    if optional:
        param.checkpoint_optional = True  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def loaded_g_idx(layer: nn.Module, name: str, group_size: int, groups: int) -> torch.Tensor:
    """The layer's ``[K]`` group indices: the checkpoint's, or ``k // group_size`` when absent.

    Raises:
        ValueError: when fused parts carry different indices, or one is out of range.
    """
    table = getattr(layer, name).data
    k = table.shape[1]
    if bool((table < 0).all()):
        return torch.arange(k, dtype=torch.int32, device=table.device) // group_size
    if bool((table < 0).any()):
        raise ValueError(f"{layer.prefix}.{name}: some fused parts have group indices, some not")
    if not bool((table == table[:1]).all()):
        raise ValueError(f"{layer.prefix}.{name}: the fused parts ({layer.shard_ids}) have "
                         f"different group indices; they must share one act-order permutation")
    g_idx = table[0].contiguous()
    if int(g_idx.max()) >= groups:
        raise ValueError(f"{layer.prefix}.{name}: group index {int(g_idx.max())} out of range "
                         f"for {groups} groups")
    return g_idx


def finalize_int_weight_only(
    layer: nn.Module,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    platform: Any,
    compute_dtype: torch.dtype,
    dequantize_at_load: bool,
    remove: tuple[str, ...],
) -> None:
    """Replace the loading parameters ``remove`` with the runtime form and pick the kernel.

    Args:
        qweight: ``[K/pack, N]`` int32, packed along K (sequential order, unsigned).
        scales, zeros: ``[G, N]`` dequant multiplier and zero point per group.
        g_idx: ``[K]`` int32 group of each input row.
        bits: 4 or 8.
        compute_dtype: the model's compute dtype; scales are kept in it when 16-bit.
    """
    kernel = choose_int_weight_only_kernel(platform)
    sixteen_bit = compute_dtype in (torch.float16, torch.bfloat16)
    side_dtype = compute_dtype if sixteen_bit else torch.float32
    if dequantize_at_load and kernel == "reference":
        from inference_engine_quant.kernels.int_weight_only_gemm import dequantize_int_weight

        dense = dequantize_int_weight(qweight, scales, zeros, g_idx, bits, compute_dtype)
        set_dense_weight(layer, dense.t(), remove)
        layer.int_kernel = "dense"
        return
    replace_params(layer, remove, qweight=qweight.contiguous(),
                   scales=scales.to(side_dtype).contiguous(),
                   zeros=zeros.to(side_dtype).contiguous(),
                   int_g_idx=g_idx.to(torch.int32).contiguous())
    layer.int_bits = bits
    layer.int_kernel = kernel
    layer.int_platform = platform
    logger.debug("%s: int%d weight-only %s via %s", getattr(layer, "prefix", "?"), bits,
                 tuple(qweight.shape), kernel)


def apply_int_weight_only(layer: nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, K] @ W (+ bias)`` through the layer's chosen kernel, in ``x.dtype``."""
    if layer.int_kernel == "dense":
        from inference_engine.builtin.quant.unquantized import UnquantizedMethod

        return UnquantizedMethod().apply(layer, x, bias)
    if layer.int_kernel == "triton":
        return int_weight_only_triton(x, layer.qweight, layer.scales, layer.zeros,
                                      layer.int_g_idx, layer.int_bits, bias,
                                      platform=layer.int_platform)
    return int_weight_only_reference(x, layer.qweight, layer.scales, layer.zeros,
                                     layer.int_g_idx, layer.int_bits, bias)
