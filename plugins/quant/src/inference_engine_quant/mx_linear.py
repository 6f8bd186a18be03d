"""Per-layer weight formats shared by the MXFP4, MXFP8, NVFP4 and ModelOpt methods.

A :class:`LinearFormat` is the logic of one weight format for one linear
layer (create the checkpoint's parameters, convert them after loading, run
the matmul); its per-layer state lives on the layer. A
:class:`PerLayerFormatMethod` picks a format per layer prefix and forwards to
it, so one method instance can serve a mixed-precision checkpoint (NVFP4
here, FP8 there, excluded layers dense).

Online quantization (``--quantization mxfp4`` on a bf16/fp32 checkpoint)
covers the decoder's linear layers only (:func:`is_online_target`):
attention and MLP projections under ``model.layers.N``; MoE routers stay
dense, and embeddings and the LM head are never linear layers of this kind.
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from functools import partial
from typing import Any

import torch
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from inference_engine.interfaces.platform import KERNEL_TRITON_MXFP4
from inference_engine.interfaces.quant import QuantMethod
from inference_engine.layers.linear import copy_into_rows
from torch import nn

from inference_engine_quant.checkpoint_names import checkpoint_module_names
from inference_engine_quant.mx_e8m0 import ScaleRule

__all__ = [
    "DenseFormat",
    "LinearFormat",
    "PerLayerFormatMethod",
    "add_part_scalar_param",
    "add_row_param",
    "fp4_kernel_name",
    "is_online_target",
    "matches_module",
    "native_mxfp4",
    "quantized_weight_bytes",
    "replace_params",
    "use_triton_fp4",
]

# Leaf module names that stay dense under online quantization (MoE routers).
_ROUTER_NAMES = ("gate", "router")


def is_online_target(prefix: str) -> bool:
    """Whether online quantization applies to the linear layer ``prefix``.

    Decoder layers' attention and MLP/expert projections (``model.layers.N...``)
    are quantized; routers (``mlp.gate``, ``mlp.router``) and anything outside
    the decoder layers are not.
    """
    leaf = prefix.rpartition(".")[2]
    return ".layers." in f".{prefix}" and leaf not in _ROUTER_NAMES


def matches_module(prefix: str, patterns: list[str]) -> bool:
    """Whether a checkpoint module of layer ``prefix`` (or a parent module) matches a pattern.

    Patterns are exact module names or ``fnmatch`` wildcards (ModelOpt's
    ``exclude_modules``); fused layers are matched by their checkpoint names
    (``qkv_proj`` by ``q_proj``/``k_proj``/``v_proj``). Unlike substring
    matching, ``model.layers.0.mlp.gate`` does not match ``mlp.gate_proj``.
    """
    for name in checkpoint_module_names(prefix) + [prefix]:
        parts = name.split(".")
        candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        for pattern in patterns:
            if any(c == pattern or fnmatch.fnmatchcase(c, pattern) for c in candidates):
                return True
    return False


def use_triton_fp4(platform: Any) -> bool:
    """The Triton dequant-GEMM where the platform lists a Triton FP4 kernel or says Triton
    runs (``supports_triton()``); the tiled torch reference elsewhere (CPU)."""
    from inference_engine_quant.fp8_linear import supports_triton
    from inference_engine_quant.kernels.fp4_gemm import HAS_TRITON

    if not HAS_TRITON or platform is None:
        return False
    listed = getattr(platform, "fp4_gemm_kernels", None)
    return (listed is not None and KERNEL_TRITON_MXFP4 in listed()) or supports_triton(platform)


def native_mxfp4(platform: Any) -> bool:
    """Whether ``platform`` lists the block-scaled ``tl.dot_scaled`` MXFP4 GEMM in its
    ``fp4_gemm_kernels()`` (CUDA sm100+, ROCm gfx950) and Triton is installed."""
    from inference_engine_quant.kernels.mx_dot_scaled_gemm import HAS_TRITON

    listed = getattr(platform, "fp4_gemm_kernels", None)
    return HAS_TRITON and listed is not None and KERNEL_TRITON_MXFP4 in listed()


def fp4_kernel_name(platform: Any, what: str) -> str:
    """Human name of the FP4 matmul path on ``platform`` (for ``inference-engine env``).

    MXFP4 runs the native block-scaled ``tl.dot_scaled`` GEMM (MXFP8 activations) where
    the platform lists it; NVFP4 has no native path here, so a platform with FP4 math
    (``supports_fp4()``) runs the weight-only Triton kernel for it, and says so.
    """
    if what == "MXFP4" and native_mxfp4(platform):
        return "triton MXFP4 tl.dot_scaled GEMM (MXFP8 activations, native block-scaled)"
    if not use_triton_fp4(platform):
        return f"torch tiled {what} dequantize + matmul (reference)"
    name = f"triton {what} dequant-GEMM (weight-only, 16-bit activations)"
    if platform is not None and platform.supports_fp4():
        name += "; native FP4 GEMM not implemented"
    return name


def replace_params(layer: nn.Module, remove: tuple[str, ...],
                   **tensors: torch.Tensor | None) -> None:
    """Drop the loading parameters ``remove``; register the runtime ``tensors`` (None: absent)."""
    for name in remove:
        layer._parameters.pop(name, None)
        if name in layer.__dict__:
            del layer.__dict__[name]
    for name, tensor in tensors.items():
        layer._parameters.pop(name, None)
        if tensor is None:
            setattr(layer, name, None)
        else:
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def _load_rows(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
               shard_id: int | str | None = None, *, name: str, kind: str) -> None:
    """Copy a row-major checkpoint tensor (whole, or one fused part's rows), checking its dtype."""
    if loaded.dtype != param.dtype:
        same_width = loaded.element_size() == param.element_size() == 1
        if same_width and not loaded.is_floating_point() or (
            same_width and param.dtype == torch.uint8 and loaded.dtype == torch.float8_e8m0fnu
        ):
            loaded = loaded.view(param.dtype)
        else:
            raise ValueError(
                f"{name}: expected {kind} ({param.dtype}), the checkpoint tensor is {loaded.dtype}"
            )
    copy_into_rows(layer, param, loaded, shard_id, name)


def add_row_param(layer: nn.Module, prefix: str, name: str, shape: tuple[int, ...],
                  dtype: torch.dtype, kind: str) -> nn.Parameter:
    """Register a parameter whose first dimension runs over output rows (fused parts by rows)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = partial(_load_rows, layer, name=f"{prefix}.{name}", kind=kind)  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def _load_part_scalar(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | str | None = None, *, name: str) -> None:
    """A per-tensor scalar stored once per fused part."""
    if loaded.numel() != 1:
        raise ValueError(f"shape mismatch for {name}: expected a scalar, the checkpoint tensor "
                         f"has shape {tuple(loaded.shape)}")
    if shard_id is None:
        param.data.fill_(float(loaded.float().reshape(())))
    else:
        param.data[layer.shard_ids.index(shard_id)] = loaded.float().reshape(())


def add_part_scalar_param(layer: nn.Module, prefix: str, name: str,
                          optional: bool = False) -> nn.Parameter:
    """Register ``[num_parts]`` float32 (one scalar per q/k/v or gate/up part); NaN until loaded."""
    param = nn.Parameter(torch.full((len(layer.output_sizes),), float("nan")), requires_grad=False)
    param.weight_loader = partial(_load_part_scalar, layer, name=f"{prefix}.{name}")  # type: ignore[attr-defined]
    if optional:
        param.checkpoint_optional = True  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def rows_from_parts(layer: nn.Module, per_part: torch.Tensor) -> torch.Tensor:
    """Expand ``[num_parts]`` values to one per output row ``[N]``."""
    sizes = torch.tensor(layer.output_sizes, device=per_part.device)
    return per_part.float().repeat_interleave(sizes)


class LinearFormat(ABC):
    """One weight format's logic for a linear layer; per-layer state lives on the layer."""

    # Short name for logs and reports ("mxfp4", "nvfp4", "dense").
    name: str = ""

    @abstractmethod
    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        """Register the parameters the checkpoint provides for this layer."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded parameters to the runtime form."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, K] @ W^T + bias`` -> ``[T, N]`` in ``x.dtype``."""

    def weight_memory_bytes(self, layer: nn.Module) -> int:
        """Bytes of the layer's weight and scales at run time (bias excluded)."""
        return sum(p.numel() * p.element_size()
                   for name, p in layer.named_parameters(recurse=False) if name != "bias")


class DenseFormat(LinearFormat):
    """Unquantized weights in the model dtype (excluded layers, routers)."""

    name = "dense"

    def __init__(self) -> None:
        self._method = UnquantizedMethod()

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        self._method.create_weights(layer, prefix, input_size, output_sizes, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._method.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._method.apply(layer, x, bias)


def set_dense_weight(layer: nn.Module, dense: torch.Tensor, remove: tuple[str, ...]) -> None:
    """``--dequantize-at-load``: keep only a dense ``weight [N, K]`` (column-major fp32 on CPU)."""
    replace_params(layer, remove, weight=dense.contiguous())
    UnquantizedMethod().process_weights_after_loading(layer)


class PerLayerFormatMethod(QuantMethod):
    """A quantization method that chooses a :class:`LinearFormat` per layer prefix."""

    name = ""

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        self.dequantize_at_load = bool(options.get("dequantize_at_load", False))

    @abstractmethod
    def format_for(self, prefix: str, output_sizes: list[int]) -> LinearFormat:
        """The format of the layer ``prefix`` (fused parts must agree)."""

    def scale_rule(self) -> ScaleRule:
        """The ``mx_scale_rule`` option: OCP ``floor`` (default) or ``rceil``."""
        rule = self.options.get("mx_scale_rule", "floor")
        if rule not in ("floor", "rceil"):
            raise ValueError(f"mx_scale_rule must be 'floor' or 'rceil', got {rule!r}")
        return rule

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        fmt = self.format_for(prefix, output_sizes)
        layer.linear_format = fmt
        fmt.create_weights(layer, prefix, input_size, output_sizes, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.linear_format.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.linear_format.apply(layer, x, bias)

    def weight_memory_bytes(self, layer: nn.Module) -> int:
        return layer.linear_format.weight_memory_bytes(layer)


def quantized_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Weight bytes per format name over the model's linear layers (bias excluded).

    Layers of plain methods are counted under ``"dense"``, quantized fused-MoE
    experts under their format; embeddings, norms and the LM head are not
    linear layers here and are not counted.
    """
    totals: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        fmt = getattr(module, "linear_format", None)
        name = fmt.name if fmt is not None else getattr(method, "format_name", "dense")
        if fmt is not None:
            size = fmt.weight_memory_bytes(module)
        elif hasattr(method, "format_name"):  # quantized fused-MoE experts
            size = method.weight_memory_bytes(module)
        else:
            size = sum(p.numel() * p.element_size()
                       for n, p in module.named_parameters(recurse=False) if n != "bias")
        totals[name] = totals.get(name, 0) + size
    return totals
