"""Runtime FP8 linear: the (K, N) weight, its scale grid, and the kernel chosen per platform.

Every FP8 method (checkpoint ``fp8`` per-tensor or 128x128 block, online
``ptpc_fp8``) ends its loading with :func:`finalize_fp8_layer`, which leaves on
the layer:

* ``weight [K, N]`` FP8 (the engine's layout), or its dequantized copy in the
  compute dtype under ``--dequantize-at-load`` on the reference path;
* ``weight_scale [ceil(K/bk), ceil(N/bn)]`` float32, a dequant multiplier per
  block (``fp8_block = (bk, bn)``; per channel is ``(K, 1)``);
* ``input_scale`` (static activation scale) or None for dynamic activations,
  quantized per token and per ``bk`` columns (``bk = K``: per token);
* ``fp8_kernel``: one of :data:`KERNEL_NAMES`.

Kernel choice (:func:`choose_fp8_kernel`) asks the platform's kernel lists
(``fp8_gemm_kernels()``, ``supports_triton()``), never its class or device type:
CPU (and any device where Triton cannot run) runs the reference
(QDQ the activation, dequantize the weight, matmul: the same numbers as the
FP8 GEMM); GPUs without FP8 math (``fp8_dtype() is None``: SM75/80/86) run the
Triton kernel weight-only (dequantize in the kernel, 16-bit activations);
GPUs with FP8 math use ``torch._scaled_mm`` for per-tensor/per-channel weights
with per-token activations and the Triton block GEMM for 128x128 blocks. On
fnuz hardware (ROCm gfx942) OCP checkpoints are converted at load (bytes
reinterpreted, scales doubled) and dynamic activations clamp at 224.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from inference_engine.interfaces.platform import (
    KERNEL_SCALED_MM_FP8,
    KERNEL_TRITON_FP8,
    KERNEL_TRITON_FP8_BLOCK,
)

from inference_engine_quant.fp8_cast import e4m3fn_to_fnuz
from inference_engine_quant.fp8_math import (
    dequantize_weight_kn,
    expand_scale_grid,
    qdq_activation,
    quantize_activation,
)

__all__ = [
    "KERNEL_NAMES",
    "apply_fp8_linear",
    "choose_fp8_kernel",
    "finalize_fp8_layer",
    "fp8_kernel_description",
    "fp8_layer_memory_bytes",
]

logger = logging.getLogger(__name__)

KERNEL_NAMES: dict[str, str] = {
    "reference": "torch dequantize + matmul (reference)",
    "reference_dequantized": "torch matmul on weights dequantized at load (reference)",
    "triton": "triton fp8 block GEMM",
    "triton_weight_only": "triton fp8 weight-only GEMM (dequantize in kernel, 16-bit activations)",
    "scaled_mm": "torch._scaled_mm",
}

# Largest weight (elements) the reference path dequantizes in one piece; bigger
# weights are dequantized in K slices so the temporary stays small.
_REFERENCE_TILE_ELEMENTS = 1 << 22


def _has_triton() -> bool:
    from inference_engine_quant.kernels.fp8_block_gemm import HAS_TRITON

    return HAS_TRITON


def supports_triton(platform: Any) -> bool:
    """Whether ``platform`` says Triton kernels compile for it; an object that does not
    answer ``supports_triton()`` is taken to say no (never guessed from its device type)."""
    answer = getattr(platform, "supports_triton", None)
    return bool(answer()) if answer is not None else False


def fp8_gemm_kernels(platform: Any) -> list[str]:
    """``platform.fp8_gemm_kernels()``: its native FP8 x FP8 matmul paths (empty: none).

    A platform object without the list (a minimal simulated GPU) is answered from its
    ``fp8_dtype()`` and ``supports_triton()``, as the CUDA and ROCm platforms build theirs.
    """
    if platform is None:
        return []
    kernels = getattr(platform, "fp8_gemm_kernels", None)
    if kernels is not None:
        return list(kernels())
    if platform.fp8_dtype() is None:
        return []
    triton = [KERNEL_TRITON_FP8, KERNEL_TRITON_FP8_BLOCK] if supports_triton(platform) else []
    return [KERNEL_SCALED_MM_FP8, *triton]


def choose_fp8_kernel(platform: Any, blockwise: bool, dequantize_at_load: bool = False) -> str:
    """The FP8 matmul path for ``platform``; a key of :data:`KERNEL_NAMES`.

    Asks the platform's kernel lists: ``_scaled_mm`` for per-tensor/channel weights
    and the Triton block GEMM where :meth:`fp8_gemm_kernels` lists them; without
    native FP8 the Triton weight-only GEMM where Triton runs; else the reference.

    Args:
        platform: a :class:`~inference_engine.interfaces.platform.Platform`
            (None: no device kernels, the reference).
        blockwise: the weight has 128x128 (or other sub-K) blocks.
        dequantize_at_load: the user traded memory for speed (reference path only).
    """
    native = fp8_gemm_kernels(platform)
    if not native:
        if _has_triton() and supports_triton(platform):
            return "triton_weight_only"
    elif not blockwise and KERNEL_SCALED_MM_FP8 in native and hasattr(torch, "_scaled_mm"):
        return "scaled_mm"
    elif _has_triton() and (KERNEL_TRITON_FP8_BLOCK if blockwise else KERNEL_TRITON_FP8) in native:
        return "triton"
    return "reference_dequantized" if dequantize_at_load else "reference"


def fp8_kernel_description(platform: Any, blockwise: bool | None = None) -> str:
    """Human name of the path(s) used on ``platform``; both schemes when ``blockwise`` is None."""
    if blockwise is not None:
        return KERNEL_NAMES[choose_fp8_kernel(platform, blockwise)]
    per_tensor = KERNEL_NAMES[choose_fp8_kernel(platform, False)]
    block = KERNEL_NAMES[choose_fp8_kernel(platform, True)]
    if per_tensor == block:
        return per_tensor
    return f"{per_tensor} (per-tensor/channel), {block} (128x128 block)"


def finalize_fp8_layer(
    layer: nn.Module,
    weight_kn: torch.Tensor,
    scale_kn: torch.Tensor,
    block_kn: tuple[int, int],
    input_scale: torch.Tensor | None,
    act_quant: bool,
    platform: Any,
    compute_dtype: torch.dtype,
    dequantize_at_load: bool = False,
) -> None:
    """Replace the layer's loading parameters with the runtime FP8 form and pick its kernel.

    Args:
        layer: the linear layer; parameters ``weight``/``weight_scale``/
            ``input_scale`` are (re)registered.
        weight_kn: ``[K, N]`` float8 (e4m3fn from checkpoints and online quantization).
        scale_kn: scale grid ``[ceil(K/bk), ceil(N/bn)]``.
        block_kn: ``(bk, bn)``.
        input_scale: 0-d static activation scale, or None.
        act_quant: quantize activations (False only for weight-only kernels).
        platform: the platform (None: CPU).
        compute_dtype: the model's compute dtype (activations, outputs).
        dequantize_at_load: keep a compute-dtype copy instead of FP8 (reference only).
    """
    k, n = weight_kn.shape
    blockwise = block_kn[0] < k or block_kn[1] > 1
    kernel = choose_fp8_kernel(platform, blockwise, dequantize_at_load)
    if kernel == "scaled_mm" and (k % 16 or n % 16) and weight_kn.device.type != "cpu":
        # cuBLASLt FP8 GEMMs need K and N to be multiples of 16; tiny layers take the Triton GEMM.
        kernel = "triton" if _has_triton() else "reference"
    fp8_dtype = platform.fp8_dtype() if platform is not None else None
    scale_kn = scale_kn.float()
    if fp8_dtype == torch.float8_e4m3fnuz and weight_kn.dtype == torch.float8_e4m3fn:
        scales = (scale_kn,) if input_scale is None else (scale_kn, input_scale)
        weight_kn, *doubled = e4m3fn_to_fnuz(weight_kn, *scales)
        scale_kn = doubled[0]
        input_scale = doubled[1] if input_scale is not None else None
    if kernel == "scaled_mm":
        weight_kn = weight_kn.t().contiguous().t()  # column-major (K, N), as _scaled_mm wants
        # _scaled_mm takes one scale per output column: a per-tensor grid is expanded.
        scale_kn = scale_kn.expand(1, n).contiguous()
    elif kernel == "reference_dequantized":
        weight_kn = dequantize_weight_kn(weight_kn, scale_kn, block_kn, compute_dtype)
    else:
        weight_kn = weight_kn.contiguous()
    for name in ("weight", "weight_scale", "weight_scale_inv", "input_scale"):
        if name in layer._parameters:
            del layer._parameters[name]
    layer.register_parameter("weight", nn.Parameter(weight_kn, requires_grad=False))
    layer.register_parameter("weight_scale",
                             nn.Parameter(scale_kn.contiguous(), requires_grad=False))
    if input_scale is not None:
        layer.register_parameter(
            "input_scale", nn.Parameter(input_scale.float().reshape(()), requires_grad=False)
        )
    else:
        layer.input_scale = None
    layer.fp8_block = block_kn
    layer.fp8_act_quant = act_quant
    layer.fp8_kernel = kernel
    layer.fp8_dtype = fp8_dtype or torch.float8_e4m3fn
    layer.fp8_compute_dtype = compute_dtype
    layer.fp8_platform = platform
    logger.debug("%s: FP8 %s blocks %s via %s", getattr(layer, "prefix", "?"),
                 tuple(weight_kn.shape), block_kn, kernel)


def apply_fp8_linear(
    layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [T, K] @ W [K, N] (+ bias)`` through the layer's FP8 kernel, in ``x.dtype``."""
    kernel = layer.fp8_kernel
    if kernel in ("reference", "reference_dequantized"):
        return _apply_reference(layer, x, bias)
    if kernel == "scaled_mm":
        return _apply_scaled_mm(layer, x, bias)
    return _apply_triton(layer, x, bias, weight_only=kernel == "triton_weight_only")


def _act_group(layer: nn.Module, k: int) -> int:
    bk = layer.fp8_block[0]
    return k if bk >= k else bk


def _apply_reference(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weight = layer.weight
    k, n = weight.shape
    compute = torch.float32 if layer.fp8_compute_dtype == torch.float32 else x.dtype
    xf = x.float()
    if layer.fp8_act_quant:
        xf = qdq_activation(xf, _act_group(layer, k), layer.fp8_dtype, layer.input_scale)
    xc = xf.to(compute)
    if layer.fp8_kernel == "reference_dequantized":
        y = xc @ weight.to(compute)
    elif layer.fp8_block[0] >= k and k * n <= _REFERENCE_TILE_ELEMENTS:
        # One scale row along K: scale the product instead of the weight (one pass less).
        column_scale = expand_scale_grid(layer.weight_scale, (1, layer.fp8_block[1]), (1, n))
        y = (xc @ weight.to(compute)) * column_scale.to(compute)
    elif k * n <= _REFERENCE_TILE_ELEMENTS:
        y = xc @ dequantize_weight_kn(weight, layer.weight_scale, layer.fp8_block, compute)
    else:
        y = _tiled_reference(xc, weight, layer.weight_scale, layer.fp8_block, compute)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def _tiled_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int], compute: torch.dtype) -> torch.Tensor:
    """Dequantize K slices (whole scale blocks) one at a time, accumulating in float32."""
    k, n = weight.shape
    sub_k = block[0] < k  # several scale rows along K; else one row covers all of K
    unit = block[0] if sub_k else 1
    rows = max(unit, (_REFERENCE_TILE_ELEMENTS // max(n, 1)) // unit * unit)
    out = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    for k0 in range(0, k, rows):
        k1 = min(k, k0 + rows)
        if sub_k:
            tile_scale, tile_block = scale[k0 // unit: -(-k1 // unit)], block
        else:
            tile_scale, tile_block = scale, (k1 - k0, block[1])
        tile = dequantize_weight_kn(weight[k0:k1], tile_scale, tile_block, compute)
        out += (x[:, k0:k1] @ tile).float()
    return out


def _apply_scaled_mm(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-token activation x per-channel weight on FP8 tensor cores (sm89+, MI300).

    Written for GPUs with FP8 math; on this project's CPU-only CI it is only
    exercised by forcing the kernel (torch's CPU ``_scaled_mm`` takes the same
    row-wise scales).
    """
    q_x, s_x = quantize_activation(x, None, layer.fp8_dtype, layer.input_scale)
    out = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    y = torch._scaled_mm(q_x, layer.weight, scale_a=s_x.contiguous(),
                         scale_b=layer.weight_scale.reshape(1, -1), bias=None, out_dtype=out)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def _apply_triton(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                  weight_only: bool) -> torch.Tensor:
    from inference_engine_quant.kernels.fp8_block_gemm import DEFAULT_CONFIG, fp8_block_gemm

    weight = layer.weight
    k, n = weight.shape
    group_k = _act_group(layer, k)
    config = _tuning(layer, x.shape[0], n, k, DEFAULT_CONFIG)
    if weight_only:
        a, a_scale = x, None
    else:
        a, a_scale = quantize_activation(x, group_k, layer.fp8_dtype, layer.input_scale)
        groups = -(-k // group_k)
        if a_scale.shape[1] != groups:  # a static scale serves every group
            a_scale = a_scale.expand(-1, groups)
        a_scale = a_scale.contiguous()
    return fp8_block_gemm(a, a_scale, weight, layer.weight_scale, group_k, layer.fp8_block[1],
                          x.dtype, bias=bias, config=config)


def _tuning(layer: nn.Module, m: int, n: int, k: int, default: dict[str, Any]) -> dict[str, Any]:
    """Launch parameters from the kernel-tuning hook; M is bucketed to a power of two."""
    bucket = 1 << max(0, (max(m, 1) - 1).bit_length())
    if bucket <= 32:  # decode sizes: thin row tiles, narrow N tiles, split-K fills the GPU
        default = {**default, "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64}
    op = "fp8_block_gemm" if layer.fp8_block[0] < k or layer.fp8_block[1] > 1 else "fp8_gemm"
    try:
        from inference_engine.kernel_tuning import tuning_config
    except ImportError:  # older core without the tuning helper
        return dict(default)
    return tuning_config(op, {"M": bucket, "N": n, "K": k}, default,
                         platform=getattr(layer, "fp8_platform", None))


def fp8_layer_memory_bytes(layer: nn.Module) -> int:
    """Bytes of the layer's weight, scales and bias at run time."""
    return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))
