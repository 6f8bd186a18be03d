"""``--quantization mxfp8``: online MXFP8 of a bf16/fp32 checkpoint (:mod:`.mxfp8` formats).

A ModelOpt ``MXFP8`` checkpoint given the flag is handed to the ``modelopt``
method's per-layer logic (:func:`~inference_engine_quant.modelopt.modelopt_delegate`).
"""

from __future__ import annotations

from typing import Any

from inference_engine_quant.fp8 import current_platform_or_none
from inference_engine_quant.modelopt import modelopt_delegate
from inference_engine_quant.mx_linear import (
    DenseFormat,
    LinearFormat,
    PerLayerFormatMethod,
    is_online_target,
    native_mxfp4,
)
from inference_engine_quant.mxfp8 import Mxfp8Format

__all__ = ["Mxfp8Method"]


class Mxfp8Method(PerLayerFormatMethod):
    """Online MXFP8 of the decoder's linear layers (``--quantization mxfp8``).

    A ModelOpt checkpoint given ``--quantization mxfp8`` goes to the ``modelopt``
    per-layer logic. Options: ``dequantize_at_load``, ``mx_scale_rule``.

    Raises:
        ValueError: for a checkpoint quantized with another method, or an unknown rule.
    """

    name = "mxfp8"
    # Values and E8M0 scales cut with their rows / whole 32-value blocks of K (online too).
    supports_tensor_parallel = True

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        self._delegate = modelopt_delegate(self, "MXFP8")
        rule = self.scale_rule()
        self._mxfp8 = Mxfp8Format(True, self.dequantize_at_load, rule,
                                  current_platform_or_none(self.options))
        self._dense = DenseFormat()

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        if native_mxfp4(platform):
            return "triton MXFP8 tl.dot_scaled GEMM (MXFP8 activations, native block-scaled)"
        return "torch MXFP8 dequantize + matmul (reference, weight-only)"

    def format_for(self, prefix: str, output_sizes: list[int]) -> LinearFormat:
        if self._delegate is not None:
            return self._delegate.format_for(prefix, output_sizes)
        return self._mxfp8 if is_online_target(prefix) else self._dense
