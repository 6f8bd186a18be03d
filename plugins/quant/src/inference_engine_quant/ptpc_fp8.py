"""``ptpc_fp8``: quantize a 16/32-bit checkpoint to FP8 at load, per channel and per token.

No offline step (quant-formats.md section 5): the checkpoint is plain; after
loading each decoder linear weight gets ``s_w[n] = amax(|W[n, :]|) / fp8max``
and ``q_w = fp8(W / s_w)``, stored (K, N). Every forward quantizes the
activation with ``s_x[t] = amax(|x[t, :]|) / fp8max``; the GEMM is
``(q_x @ q_w) * s_x * s_w``. ``fp8max`` is 448 for OCP e4m3fn and 224 on fnuz
(ROCm gfx942), where the weight is quantized straight to fnuz.

Only layers built through the model's quant method are touched: attention
and MLP projections. Embeddings and the LM head stay in the model dtype.
Selected with ``--quantization ptpc_fp8`` / ``LLM(model, quantization="ptpc_fp8")``.
"""

from __future__ import annotations

from typing import Any

import torch
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from torch import nn

from inference_engine_quant.fp8 import current_platform_or_none
from inference_engine_quant.fp8_cast import fp8_max
from inference_engine_quant.fp8_linear import (
    apply_fp8_linear,
    finalize_fp8_layer,
    fp8_kernel_description,
)
from inference_engine_quant.fp8_math import quantize_weight_per_channel

__all__ = ["PtpcFp8Method"]


class PtpcFp8Method(UnquantizedMethod):
    """Loads dense weights like the unquantized method, then quantizes them per channel."""

    name = "ptpc_fp8"

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        if self.checkpoint_config.get("quant_method") not in (None, "ptpc_fp8"):
            raise ValueError(
                f"ptpc_fp8 quantizes a plain checkpoint at load, but this checkpoint is already "
                f"quantized ({self.checkpoint_config.get('quant_method')!r}); drop "
                f"--quantization to use its own method"
            )
        self.dequantize_at_load = bool(options.get("dequantize_at_load", False))

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return fp8_kernel_description(platform, blockwise=False)

    def fused_moe_method(self, prefix: str) -> Any | None:
        """Experts quantized at load with one scale per row (the PTPC weight scheme), run
        weight-only through the quantized grouped GEMM."""
        from inference_engine_quant.fp8_moe import Fp8FusedMoEMethod

        return Fp8FusedMoEMethod(None, online=True)

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        super().create_weights(layer, prefix, input_size, output_sizes, params_dtype)
        layer.fp8_params_dtype = params_dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        platform = current_platform_or_none(self.options)
        fp8_dtype = (platform.fp8_dtype() if platform is not None else None) or torch.float8_e4m3fn
        weight = layer.weight.data
        q, s = quantize_weight_per_channel(weight, fp8_dtype, fp8_max(fp8_dtype, dynamic=True))
        # Weight already in the platform's flavour: no fn->fnuz conversion needed.
        finalize_fp8_layer(
            layer, q.t(), s.reshape(1, -1), (weight.shape[1], 1), None, act_quant=True,
            platform=platform, compute_dtype=layer.fp8_params_dtype,
            dequantize_at_load=self.dequantize_at_load,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_fp8_linear(layer, x, bias)
