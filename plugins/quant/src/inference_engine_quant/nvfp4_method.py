"""``--quantization nvfp4``: online NVFP4 (W4A16) of a bf16/fp32 checkpoint (:mod:`.nvfp4` formats).

A ModelOpt ``NVFP4`` checkpoint given the flag is handed to the ``modelopt``
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
    fp4_kernel_name,
    is_online_target,
)
from inference_engine_quant.nvfp4 import Nvfp4Format

__all__ = ["Nvfp4Method"]


class Nvfp4Method(PerLayerFormatMethod):
    """Online NVFP4 (W4A16) of the decoder's linear layers (``--quantization nvfp4``).

    A ModelOpt NVFP4 checkpoint given ``--quantization nvfp4`` is handed to the
    same per-layer logic as the ``modelopt`` method would use.

    Raises:
        ValueError: for a checkpoint quantized with another method.
    """

    name = "nvfp4"

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        self._delegate = modelopt_delegate(self, "NVFP4")
        platform = current_platform_or_none(self.options)
        self._nvfp4 = Nvfp4Format(True, self.dequantize_at_load, platform)
        self._dense = DenseFormat()

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return fp4_kernel_name(platform, "NVFP4")

    def format_for(self, prefix: str, output_sizes: list[int]) -> LinearFormat:
        if self._delegate is not None:
            return self._delegate.format_for(prefix, output_sizes)
        return self._nvfp4 if is_online_target(prefix) else self._dense
