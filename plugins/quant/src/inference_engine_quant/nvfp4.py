"""``nvfp4``: E2M1 weights, an FP8 E4M3 scale per 16, an FP32 global scale (ModelOpt layout).

Per linear layer a ModelOpt NVFP4 checkpoint stores (quant-formats.md sections 7-8):
``weight`` U8 ``[N, K/2]``, ``weight_scale`` F8_E4M3 ``[N, K/16]``,
``weight_scale_2`` F32 scalar (the global ``g``) and ``input_scale`` F32 scalar
(calibrated activations). Such checkpoints arrive through the ``modelopt``
method (:mod:`.modelopt`), which uses :class:`Nvfp4Format` per layer;
``--quantization nvfp4`` quantizes a bf16/fp32 checkpoint online with one
global scale per layer.

Activations: with an ``input_scale`` (checkpoints) each matmul quantizes its
input to NVFP4 blocks of 16 (W4A4, emulated as quantize-dequantize on
hardware without FP4 math); online ``nvfp4`` is weight-only (W4A16), since
there is no calibration data for a static activation scale. Fused q/k/v
and gate/up parts keep their own ``weight_scale_2`` (one global per output
row, exact); their ``input_scale`` values are merged by the max, as vLLM
does, because the parts share one input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from inference_engine.layers.tp_blocks import check_row_shard_blocks
from torch import nn

from inference_engine_quant.kernels.fp4_gemm import fp4_linear_reference
from inference_engine_quant.mx_linear import (
    DenseFormat,
    LinearFormat,
    add_part_scalar_param,
    add_row_param,
    replace_params,
    rows_from_parts,
    set_dense_weight,
    use_triton_fp4,
)
from inference_engine_quant.nvfp4_codec import (
    NVFP4_BLOCK_SIZE,
    dequantize_nvfp4,
    nvfp4_global_scale,
    qdq_nvfp4_activation,
    quantize_nvfp4_with_global,
)

__all__ = ["Nvfp4Format", "merged_input_scale"]


def merged_input_scale(layer: nn.Module, per_part: torch.Tensor,
                       prefix: str) -> torch.Tensor | None:
    """The max of the parts' static input scales; None when the checkpoint has none.

    Raises:
        ValueError: when only some fused parts carry an ``input_scale``.
    """
    missing = torch.isnan(per_part)
    if bool(missing.all()):
        return None
    if bool(missing.any()):
        parts = [str(s) for s, m in zip(layer.shard_ids, missing.tolist(), strict=True) if m]
        raise ValueError(f"{prefix}.input_scale is missing for part(s) {', '.join(parts)} "
                         f"while other parts of the fused layer have one")
    return per_part.float().max().reshape(())


class Nvfp4Format(LinearFormat):
    """NVFP4 weights of one linear layer, from a ModelOpt checkpoint or quantized online.

    Runtime parameters: ``weight [N, Kp/2]`` uint8, ``weight_scale [N, Kp/16]``
    float8_e4m3fn, ``weight_global [N]`` float32 and ``input_scale`` (0-d or
    None); or a dense ``weight`` under ``dequantize_at_load``.
    """

    name = "nvfp4"

    def __init__(self, online: bool, dequantize_at_load: bool = False,
                 platform: Any = None) -> None:
        self.online = online
        self.dequantize_at_load = dequantize_at_load
        self.platform = platform
        self._dense = DenseFormat()

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.mx_input_size = input_size
        layer.mx_params_dtype = params_dtype
        layer.mx_prefix = prefix
        # Row-parallel: each rank's input columns whole 16-value blocks (their E4M3 scales);
        # the per-part global scale is a scalar every rank keeps whole.
        check_row_shard_blocks(layer, NVFP4_BLOCK_SIZE, "NVFP4")
        if self.online:
            self._dense.create_weights(layer, prefix, input_size, output_sizes, params_dtype)
            return
        n, kb = sum(output_sizes), -(-input_size // NVFP4_BLOCK_SIZE)
        add_row_param(layer, prefix, "weight", (n, kb * NVFP4_BLOCK_SIZE // 2), torch.uint8,
                      "U8 packed FP4 [N, K/2]")
        add_row_param(layer, prefix, "weight_scale", (n, kb), torch.float8_e4m3fn,
                      "F8_E4M3 block scales [N, K/16]")
        add_part_scalar_param(layer, prefix, "weight_scale_2")
        add_part_scalar_param(layer, prefix, "input_scale", optional=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            w = layer.weight.data
            g = nvfp4_global_scale(w)
            packed, block_scales = quantize_nvfp4_with_global(w, g)
            g_rows = g.expand(w.shape[0]).clone()
            input_scale = None
        else:
            packed, block_scales = layer.weight.data, layer.weight_scale.data
            if bool(torch.isnan(layer.weight_scale_2.data).any()):
                raise ValueError(f"{layer.mx_prefix}.weight_scale_2 was not loaded")
            g_rows = rows_from_parts(layer, layer.weight_scale_2.data)
            input_scale = merged_input_scale(layer, layer.input_scale.data, layer.mx_prefix)
        remove = ("weight", "weight_scale", "weight_scale_2", "input_scale")
        if self.dequantize_at_load:
            dense = dequantize_nvfp4(packed, block_scales, g_rows, layer.mx_params_dtype)
            set_dense_weight(layer, dense[:, : layer.mx_input_size], remove)
            layer.mx_kernel = "dense"
        else:
            replace_params(layer, remove, weight=packed.contiguous(),
                           weight_scale=block_scales.contiguous(), weight_global=g_rows)
            layer.mx_kernel = "triton" if use_triton_fp4(self.platform) else "reference"
        replace_params(layer, (), input_scale=input_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.input_scale is not None:
            x = qdq_nvfp4_activation(x, layer.input_scale)
        kernel = layer.mx_kernel
        if kernel == "dense":
            return F.linear(x, layer.weight, bias)
        if kernel == "triton":
            from inference_engine_quant.kernels.fp4_gemm import fp4_linear_triton

            return fp4_linear_triton(x, layer.weight, layer.weight_scale, "e4m3",
                                     layer.mx_input_size, global_scale=layer.weight_global,
                                     bias=bias)
        return fp4_linear_reference(x, layer.weight, layer.weight_scale, "e4m3",
                                    layer.mx_input_size, global_scale=layer.weight_global,
                                    bias=bias)
