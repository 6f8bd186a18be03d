"""``mxfp4``: E2M1 weights with an E8M0 scale per 32 elements, kept packed in memory.

Two ways in (quant-formats.md sections 6 and 8):

* **checkpoint** (``quantization_config.quant_method == "mxfp4"``, gpt-oss
  style): each quantized linear layer stores ``weight_blocks`` U8
  ``[N, K/32, 16]`` (two codes per byte, low nibble first) and
  ``weight_scales`` U8 ``[N, K/32]`` (E8M0 bytes), the dense-layer form of
  gpt-oss's ``*_blocks`` / ``*_scales``. Modules matching
  ``modules_to_not_convert`` (gpt-oss: attention, router, embeddings, LM head)
  stay dense. gpt-oss's expert tensors belong to the fused-MoE layer, which
  dequantizes them with :func:`inference_engine_quant.mx_block.dequantize_mxfp4`.
* **online** (``--quantization mxfp4`` on a bf16/fp32 checkpoint): decoder
  attention and MLP weights are quantized at load with the OCP scale rule
  (``floor(log2(amax)) - 2``; option ``mx_scale_rule="rceil"``).

At run time the weight stays packed (0.5 byte per value + 1/32 byte of scale:
~0.53 bytes/param) and each matmul dequantizes it tile by tile (torch
reference on CPU, the Triton dequant-GEMM on GPUs). ``dequantize_at_load``
(``--dequantize-at-load``) instead keeps a dense copy in the model dtype:
faster on CPU, where there is no FP4 math, at bf16 memory cost.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from inference_engine.layers.tp_blocks import check_row_shard_blocks
from torch import nn

from inference_engine_quant.fp8 import current_platform_or_none, is_ignored
from inference_engine_quant.kernels.fp4_gemm import fp4_linear_reference
from inference_engine_quant.mx_block import MX_BLOCK_SIZE, dequantize_mxfp4, quantize_mxfp4
from inference_engine_quant.mx_e8m0 import ScaleRule
from inference_engine_quant.mx_linear import (
    DenseFormat,
    LinearFormat,
    PerLayerFormatMethod,
    add_row_param,
    fp4_kernel_name,
    is_online_target,
    matches_module,
    native_mxfp4,
    replace_params,
    set_dense_weight,
    use_triton_fp4,
)

__all__ = ["Mxfp4Format", "Mxfp4Method"]


class Mxfp4Format(LinearFormat):
    """MXFP4 weights of one linear layer, from a checkpoint or quantized online.

    Runtime parameters: ``weight_blocks [N, Kp/32, 16]`` and ``weight_scales
    [N, Kp/32]`` (uint8), or a dense ``weight`` under ``dequantize_at_load``.
    """

    name = "mxfp4"

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
        # Row-parallel: each rank's input columns must be whole 32-value blocks (online too,
        # so a rank quantizes the same blocks one process would).
        check_row_shard_blocks(layer, MX_BLOCK_SIZE, "MXFP4")
        if self.online:
            self._dense.create_weights(layer, prefix, input_size, output_sizes, params_dtype)
            return
        n, kb = sum(output_sizes), -(-input_size // MX_BLOCK_SIZE)
        add_row_param(layer, prefix, "weight_blocks", (n, kb, MX_BLOCK_SIZE // 2), torch.uint8,
                      "U8 MXFP4 blocks [N, K/32, 16]")
        add_row_param(layer, prefix, "weight_scales", (n, kb), torch.uint8,
                      "U8 E8M0 scales [N, K/32]")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            packed, scales = quantize_mxfp4(layer.weight.data, self.rule)
            blocks = packed.unflatten(-1, (-1, MX_BLOCK_SIZE // 2))
        else:
            blocks, scales = layer.weight_blocks.data, layer.weight_scales.data
        remove = ("weight", "weight_blocks", "weight_scales")
        if self.dequantize_at_load:
            dense = dequantize_mxfp4(blocks, scales, layer.mx_params_dtype)
            set_dense_weight(layer, dense[:, : layer.mx_input_size], remove)
            layer.mx_kernel = "dense"
            return
        replace_params(layer, remove, weight_blocks=blocks.contiguous(),
                       weight_scales=scales.contiguous())
        if native_mxfp4(self.platform):
            layer.mx_kernel = "dot_scaled"
        else:
            layer.mx_kernel = "triton" if use_triton_fp4(self.platform) else "reference"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = layer.mx_kernel
        if kernel == "dense":
            return F.linear(x, layer.weight, bias)
        packed = layer.weight_blocks.flatten(-2)
        if kernel == "dot_scaled":
            from inference_engine_quant.kernels.mx_dot_scaled_gemm import mxfp4_dot_scaled_linear

            return mxfp4_dot_scaled_linear(x, packed, layer.weight_scales, layer.mx_input_size,
                                           bias=bias)
        if kernel == "triton":
            from inference_engine_quant.kernels.fp4_gemm import fp4_linear_triton

            return fp4_linear_triton(x, packed, layer.weight_scales, "e8m0", layer.mx_input_size,
                                     bias=bias)
        return fp4_linear_reference(x, packed, layer.weight_scales, "e8m0", layer.mx_input_size,
                                    bias=bias)


class Mxfp4Method(PerLayerFormatMethod):
    """MXFP4 linear layers: gpt-oss-style checkpoints, or online from bf16/fp32.

    Options: ``dequantize_at_load`` (bool), ``mx_scale_rule`` (``"floor"`` or
    ``"rceil"``, online only), ``platform`` (defaults to the current one).

    Raises:
        ValueError: for a checkpoint quantized with another method, or an unknown rule.
    """

    name = "mxfp4"
    # Blocks and scales are cut with their rows (column-parallel) or in whole 32-value
    # blocks of K (row-parallel, :func:`check_row_shard_blocks`); experts are not (FusedMoE).
    supports_tensor_parallel = True

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        method = self.checkpoint_config.get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"--quantization mxfp4 cannot run a checkpoint already quantized with "
                             f"{method!r}; drop the flag to use the checkpoint's own method")
        self.online = method is None
        rule = self.scale_rule()
        self.ignored = [str(p) for p in self.checkpoint_config.get("modules_to_not_convert") or []]
        self.rule = rule
        platform = current_platform_or_none(self.options)
        self._mxfp4 = Mxfp4Format(self.online, self.dequantize_at_load, rule, platform)
        self._dense = DenseFormat()

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return fp4_kernel_name(platform, "MXFP4")

    def fused_moe_method(self, prefix: str) -> Any | None:
        """gpt-oss experts (``*_blocks``/``*_scales``), or experts quantized online."""
        from inference_engine_quant.mxfp4_moe import Mxfp4FusedMoEMethod

        if not self.online and (is_ignored(prefix, self.ignored)
                                or matches_module(prefix, self.ignored)):
            return None
        return Mxfp4FusedMoEMethod(self.online, self.dequantize_at_load, self.rule)

    def format_for(self, prefix: str, output_sizes: list[int]) -> LinearFormat:
        if self.online:
            return self._mxfp4 if is_online_target(prefix) else self._dense
        # transformers matches modules_to_not_convert by substring, gpt-oss's own list by
        # wildcard on a parent module ("model.layers.*.self_attn"): accept both.
        ignored = is_ignored(prefix, self.ignored) or matches_module(prefix, self.ignored)
        return self._dense if ignored else self._mxfp4
