"""``gptq``: GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), 4 or 8 bits.

``quantization_config``: ``quant_method: "gptq"``, ``bits`` (4, 8),
``group_size`` (-1: one group over K), ``desc_act`` (act order), ``sym``,
``checkpoint_format`` (``"gptq"``, the default, or ``"gptq_v2"``).

Tensors per linear layer (``N`` out, ``K`` in, ``pack = 32/bits``, ``G`` groups):

* ``qweight [K/pack, N]`` int32: ``pack`` unsigned values along K per word,
  value ``j`` at bits ``j*bits`` (AutoGPTQ ``QuantLinear.pack``);
* ``qzeros [G, N/pack]`` int32: zero points packed along N the same way; the
  ``gptq`` (v1) format stores ``zero - 1`` (its packer runs ``zeros -= 1``, its
  kernels add the 1 back and mask to ``bits``), ``gptq_v2`` stores the zero;
* ``scales [G, N]`` (fp16 usually);
* ``g_idx [K]`` int32: the group of each input row, ``k // group_size`` unless
  ``desc_act`` quantized the columns in another order.

``W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``. Symmetric checkpoints
store the zero point ``2^(bits-1)`` explicitly, so the formula is the same.

Not supported (clear errors): 2/3-bit, a quantized ``lm_head``, per-module
``dynamic`` overrides; fused parts (q/k/v, gate/up) must share ``g_idx``.
"""

from __future__ import annotations

from typing import Any

import torch
from inference_engine.interfaces.quant import QuantMethod
from torch import nn

from inference_engine_quant.fp8 import current_platform_or_none
from inference_engine_quant.int_packing import pack_factor, unpack_along
from inference_engine_quant.int_weight_only import (
    add_column_param,
    add_g_idx_param,
    apply_int_weight_only,
    finalize_int_weight_only,
    int_weight_only_kernel_name,
    loaded_g_idx,
)
from inference_engine_quant.mx_linear import DenseFormat, matches_module

__all__ = ["GptqMethod", "gptq_group_count"]

_LOADING_PARAMS = ("qweight", "qzeros", "scales", "g_idx")


def gptq_group_count(k: int, group_size: int) -> int:
    """Groups along K: ``ceil(K / group_size)``, one for ``group_size == -1``."""
    return 1 if group_size == -1 else -(-k // group_size)


class GptqMethod(QuantMethod):
    """Loads GPTQ ``qweight``/``qzeros``/``scales``/``g_idx`` into the int weight-only form.

    Raises:
        ValueError: for an unsupported width, format or option, naming it.
    """

    name = "gptq"

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        cfg = self.checkpoint_config
        if cfg.get("quant_method") != "gptq":
            raise ValueError(f"--quantization gptq needs a GPTQ checkpoint (quantization_config "
                             f"quant_method 'gptq'), this one has {cfg.get('quant_method')!r}")
        self.bits = int(cfg.get("bits", 4))
        pack_factor(self.bits)
        self.group_size = int(cfg.get("group_size", 128))
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"GPTQ group_size must be positive or -1, got {self.group_size}")
        self.desc_act = bool(cfg.get("desc_act", False))
        fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported "
                             f"(supported: gptq, gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0
        if cfg.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        if cfg.get("dynamic"):
            raise ValueError("GPTQ per-module 'dynamic' overrides are not supported")
        self.excluded = [str(p) for p in (cfg.get("modules_to_not_convert") or [])]
        self.dequantize_at_load = bool(options.get("dequantize_at_load", False))
        self._dense = DenseFormat()

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return int_weight_only_kernel_name(platform)

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.int_quantized = not matches_module(prefix, self.excluded)
        layer.int_params_dtype = params_dtype
        if not layer.int_quantized:
            self._dense.create_weights(layer, prefix, input_size, output_sizes, params_dtype)
            return
        pack = pack_factor(self.bits)
        k, n = input_size, sum(output_sizes)
        if k % pack:
            raise ValueError(f"{prefix}: input size {k} is not a multiple of {pack} "
                             f"({self.bits}-bit GPTQ packs {pack} rows per word)")
        groups = gptq_group_count(k, self.group_size)
        add_column_param(layer, prefix, "qweight", (k // pack, n), torch.int32)
        add_column_param(layer, prefix, "qzeros", (groups, n // pack), torch.int32, pack)
        add_column_param(layer, prefix, "scales", (groups, n), torch.float32)
        # Always written by AutoGPTQ; GPTQModel may leave it out without act order.
        add_g_idx_param(layer, prefix, "g_idx", k, optional=not self.desc_act)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.int_quantized:
            self._dense.process_weights_after_loading(layer)
            return
        pack = pack_factor(self.bits)
        k = layer.qweight.shape[0] * pack
        groups = layer.scales.shape[0]
        group_size = k if self.group_size == -1 else self.group_size
        g_idx = loaded_g_idx(layer, "g_idx", group_size, groups)
        stored = unpack_along(layer.qzeros.data, self.bits, dim=1)
        zeros = (stored + self.zero_offset) & ((1 << self.bits) - 1)
        finalize_int_weight_only(
            layer, layer.qweight.data, layer.scales.data, zeros.float(), g_idx, self.bits,
            current_platform_or_none(self.options), layer.int_params_dtype,
            self.dequantize_at_load, _LOADING_PARAMS,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if not layer.int_quantized:
            return self._dense.apply(layer, x, bias)
        return apply_int_weight_only(layer, x, bias)
