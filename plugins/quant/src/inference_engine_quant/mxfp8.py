"""``mxfp8``: E4M3 weights with an E8M0 scale per 32 elements along K.

Checkpoints (ModelOpt ``quant_algo: MXFP8``, through the ``modelopt`` method)
store ``weight`` F8_E4M3 ``[N, K]`` and ``weight_scale`` U8 ``[N, K/32]``;
``--quantization mxfp8`` quantizes a bf16/fp32 checkpoint online with the OCP
rule (``floor(log2(amax)) - 8``). Inside the engine the FP8 values are held in
the (K, N) layout like every FP8 weight (scales ``[K/32, N]``), transposed once
at load. The matmul dequantizes K slices of whole scale blocks and multiplies
in the activation dtype; activations are not quantized (weight-only), which
is also how GPUs without MX tensor cores run it. Where the platform lists
Triton's ``dot_scaled`` MX GEMM (``native_mxfp4``: sm100+, gfx950) the layer
runs :func:`~inference_engine_quant.kernels.mx_dot_scaled_gemm.mx_dot_scaled_linear`
instead (activations quantized to MXFP8 per call, both operands microscaled).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from inference_engine.layers.tp_blocks import check_row_shard_blocks
from torch import nn

from inference_engine_quant.mx_block import (
    MX_BLOCK_SIZE,
    dequantize_mxfp8,
    pad_to_block,
    quantize_mxfp8,
)
from inference_engine_quant.mx_e8m0 import ScaleRule, decode_e8m0
from inference_engine_quant.mx_linear import (
    DenseFormat,
    LinearFormat,
    add_row_param,
    native_mxfp4,
    replace_params,
    set_dense_weight,
)

__all__ = ["Mxfp8Format", "mxfp8_linear_reference"]

# K rows of the (K, N) weight dequantized at once (a multiple of 32).
_TILE_ELEMENTS = 1 << 20

# E8M0 byte -> float32 scale, shaped for F.embedding.
_E8M0_LUT = decode_e8m0(torch.arange(256, dtype=torch.uint8)).unsqueeze(1)


def mxfp8_linear_reference(x: torch.Tensor, values_kn: torch.Tensor, scales_kn: torch.Tensor,
                           input_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, K] @ dequant(W) [K, N] (+ bias)``, dequantizing whole 32-row blocks per tile.

    Args:
        values_kn: ``[Kp, N]`` float8_e4m3fn.
        scales_kn: ``[Kp/32, N]`` uint8 E8M0 bytes.
        input_size: K (``Kp - K`` padding rows are skipped).
    """
    kp, n = values_kn.shape
    rows = max(MX_BLOCK_SIZE, _TILE_ELEMENTS // max(n, 1) // MX_BLOCK_SIZE * MX_BLOCK_SIZE)
    out = None
    for k0 in range(0, input_size, rows):  # k0 is a multiple of 32: tiles hold whole blocks
        k1 = min(kp, k0 + rows)
        k_used = min(input_size, k1) - k0
        # [blocks, 1, N] scales broadcast over the 32 rows of each block.
        scale = F.embedding(scales_kn[k0 // MX_BLOCK_SIZE: k1 // MX_BLOCK_SIZE].int(),
                            _E8M0_LUT.to(values_kn.device)).view(-1, 1, n)
        tile = values_kn[k0:k1].float().view(-1, MX_BLOCK_SIZE, n).mul_(scale).view(-1, n)
        part = x[..., k0:k0 + k_used] @ tile[:k_used].to(x.dtype)
        out = part if out is None else out + part
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


class Mxfp8Format(LinearFormat):
    """MXFP8 weights of one linear layer (checkpoint ``weight``/``weight_scale`` or online).

    Runtime parameters: ``weight [Kp, N]`` float8_e4m3fn and ``weight_scale
    [Kp/32, N]`` uint8, or a dense ``weight [N, K]`` under ``dequantize_at_load``.
    """

    name = "mxfp8"

    def __init__(self, online: bool, dequantize_at_load: bool = False,
                 rule: ScaleRule = "floor", platform: Any = None) -> None:
        self.online = online
        self.dequantize_at_load = dequantize_at_load
        self.rule = rule
        self.platform = platform
        self._dense = DenseFormat()

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.mx_input_size = input_size
        layer.mx_params_dtype = params_dtype
        # Row-parallel: each rank's input columns whole 32-value blocks (online too).
        check_row_shard_blocks(layer, MX_BLOCK_SIZE, "MXFP8")
        if self.online:
            self._dense.create_weights(layer, prefix, input_size, output_sizes, params_dtype)
            return
        n, kb = sum(output_sizes), -(-input_size // MX_BLOCK_SIZE)
        add_row_param(layer, prefix, "weight", (n, input_size), torch.float8_e4m3fn,
                      "F8_E4M3 values [N, K]")
        add_row_param(layer, prefix, "weight_scale", (n, kb), torch.uint8,
                      "U8 E8M0 scales [N, K/32]")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            values, scales = quantize_mxfp8(layer.weight.data, self.rule)
        else:
            values = pad_to_block(layer.weight.data.view(torch.uint8), MX_BLOCK_SIZE)
            values, scales = values.view(torch.float8_e4m3fn), layer.weight_scale.data
        remove = ("weight", "weight_scale")
        if self.dequantize_at_load:
            dense = dequantize_mxfp8(values, scales, layer.mx_params_dtype)
            set_dense_weight(layer, dense[:, : layer.mx_input_size], remove)
            layer.mx_kernel = "dense"
            return
        replace_params(layer, remove, weight=values.t().contiguous(),
                       weight_scale=scales.t().contiguous())
        layer.mx_kernel = "dot_scaled" if native_mxfp4(self.platform) else "reference"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.mx_kernel == "dense":
            return F.linear(x, layer.weight, bias)
        if layer.mx_kernel == "dot_scaled":
            from inference_engine_quant.kernels.mx_dot_scaled_gemm import mx_dot_scaled_linear

            return mx_dot_scaled_linear(x, layer.weight.t(), layer.weight_scale.t(),
                                        layer.mx_input_size, "e4m3", bias)
        return mxfp8_linear_reference(x, layer.weight, layer.weight_scale, layer.mx_input_size,
                                      bias)
