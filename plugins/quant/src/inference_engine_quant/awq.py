"""``awq``: AutoAWQ checkpoints in the GEMM layout (4-bit, zero point, groups along K).

``quantization_config``: ``quant_method: "awq"``, ``bits`` (or ``w_bit``) 4,
``group_size`` (or ``q_group_size``, 128 usually), ``zero_point: true``,
``version: "gemm"``, optional ``modules_to_not_convert``.

Tensors per linear layer (``N`` out, ``K`` in, ``G = K / group_size``):

* ``qweight [K, N/8]`` int32: eight 4-bit values along **N** per word, in
  AWQ's interleaved order: nibble ``i`` holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``
  of its eight (AutoAWQ ``WQLinear_GEMM.from_linear``);
* ``qzeros [G, N/8]`` int32, packed the same way;
* ``scales [G, N]`` fp16.

``W[n, k] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]``
(AutoAWQ quantizes ``q = clamp(round(w / s) + z, 0, 15)``). At load the
weight is unpacked and repacked along K (:mod:`int_packing`), the runtime
form all weight-only methods share.

Not supported (clear errors): ``zero_point: false``, versions other than
``gemm`` (GEMV, Marlin, exllama layouts), widths other than 4.
"""

from __future__ import annotations

from typing import Any

import torch
from inference_engine.interfaces.quant import QuantMethod
from torch import nn

from inference_engine_quant.fp8 import current_platform_or_none
from inference_engine_quant.int_packing import pack_along, unpack_along
from inference_engine_quant.int_weight_only import (
    add_column_param,
    apply_int_weight_only,
    finalize_int_weight_only,
    int_weight_only_kernel_name,
)
from inference_engine_quant.mx_linear import DenseFormat, matches_module

__all__ = ["AwqMethod"]

_BITS = 4
_PACK = 8
_LOADING_PARAMS = ("qweight", "qzeros", "scales")


class AwqMethod(QuantMethod):
    """Loads AWQ GEMM ``qweight``/``qzeros``/``scales`` into the int weight-only form.

    Raises:
        ValueError: for an unsupported width, version or zero-point setting.
    """

    name = "awq"

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        cfg = self.checkpoint_config
        if cfg.get("quant_method") != "awq":
            raise ValueError(f"--quantization awq needs an AWQ checkpoint (quantization_config "
                             f"quant_method 'awq'), this one has {cfg.get('quant_method')!r}")
        bits = int(cfg.get("bits", cfg.get("w_bit", _BITS)))
        if bits != _BITS:
            raise ValueError(f"AWQ checkpoints with {bits}-bit weights are not supported "
                             f"(only 4-bit)")
        self.group_size = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        if self.group_size <= 0:
            raise ValueError(f"AWQ group_size must be positive, got {self.group_size}")
        if not cfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point: false) are "
                             "not supported")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported; only the GEMM layout "
                             f"(version 'gemm') is")
        self.excluded = [str(p) for p in (cfg.get("modules_to_not_convert") or [])]
        self.dequantize_at_load = bool(options.get("dequantize_at_load", False))
        self._dense = DenseFormat()

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return int_weight_only_kernel_name(platform)

    def _is_excluded(self, prefix: str) -> bool:
        # AutoAWQ matches modules_to_not_convert as substrings of module names.
        return matches_module(prefix, self.excluded) or any(
            p in prefix for p in self.excluded)

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.int_quantized = not self._is_excluded(prefix)
        layer.int_params_dtype = params_dtype
        if not layer.int_quantized:
            self._dense.create_weights(layer, prefix, input_size, output_sizes, params_dtype)
            return
        k, n = input_size, sum(output_sizes)
        if k % self.group_size or k % _PACK:
            raise ValueError(f"{prefix}: input size {k} is not a multiple of the AWQ group "
                             f"size {self.group_size}")
        groups = k // self.group_size
        add_column_param(layer, prefix, "qweight", (k, n // _PACK), torch.int32, _PACK)
        add_column_param(layer, prefix, "qzeros", (groups, n // _PACK), torch.int32, _PACK)
        add_column_param(layer, prefix, "scales", (groups, n), torch.float32)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.int_quantized:
            self._dense.process_weights_after_loading(layer)
            return
        values = unpack_along(layer.qweight.data, _BITS, dim=1, interleaved=True)  # [K, N]
        qweight = pack_along(values, _BITS, dim=0)  # [K/8, N]
        zeros = unpack_along(layer.qzeros.data, _BITS, dim=1, interleaved=True)
        k = values.shape[0]
        g_idx = torch.arange(k, dtype=torch.int32, device=values.device) // self.group_size
        finalize_int_weight_only(
            layer, qweight, layer.scales.data, zeros.float(), g_idx, _BITS,
            current_platform_or_none(self.options), layer.int_params_dtype,
            self.dequantize_at_load, _LOADING_PARAMS,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if not layer.int_quantized:
            return self._dense.apply(layer, x, bias)
        return apply_int_weight_only(layer, x, bias)
