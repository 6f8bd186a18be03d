"""``compressed-tensors``: checkpoints written by LLM Compressor / the compressed-tensors library.

``config.json`` ``quantization_config``: ``quant_method: "compressed-tensors"``,
``format`` (``pack-quantized``, ``float-quantized``, ``int-quantized``,
``naive-quantized``, or ``mixed-precision`` with a ``format`` per group),
``config_groups: {name: {targets, weights, input_activations, format?}}``,
``ignore`` (module names, ``re:`` regexes). A layer takes the scheme of the
group whose ``targets`` match it: ``"Linear"`` (every linear layer), an exact
module name or a ``re:`` pattern (``re.match`` on the checkpoint module name,
as the library matches). Fused layers (q/k/v, gate/up) need one scheme for
all their parts. Schemes and their formats:
:mod:`~inference_engine_quant.compressed_tensors_formats`.

Not supported (clear errors naming the scheme): NVFP4/MXFP4 formats (use the
``nvfp4``/``mxfp4`` checkpoints of ModelOpt / gpt-oss), 2:4 sparsity,
transforms, asymmetric or static INT8 activations, output activation
quantization. ``kv_cache_scheme`` scales are read by the core loader.
"""

from __future__ import annotations

import re
from typing import Any

from inference_engine_quant.compressed_tensors_formats import (
    CtFp8BlockFormat,
    CtFp8Format,
    CtInt8Format,
    CtPackedIntFormat,
)
from inference_engine_quant.fp8 import checkpoint_module_names, current_platform_or_none
from inference_engine_quant.fp8_linear import fp8_kernel_description
from inference_engine_quant.int8_w8a8 import INT8_KERNEL_NAMES, choose_int8_kernel
from inference_engine_quant.int_weight_only import int_weight_only_kernel_name
from inference_engine_quant.mx_linear import DenseFormat, LinearFormat, PerLayerFormatMethod

__all__ = ["CompressedTensorsMethod", "matches_target"]

_INT_FORMATS = ("pack-quantized",)
_INT8_FORMATS = ("int-quantized", "naive-quantized")
_FP8_FORMATS = ("float-quantized", "naive-quantized")


def matches_target(name: str, target: str) -> bool:
    """compressed-tensors' rule for one module name: ``re:`` regex (``re.match``) or exact."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def _scheme_label(group: str, scheme: dict[str, Any]) -> str:
    w = scheme.get("weights") or {}
    a = scheme.get("input_activations") or {}
    act = f", activations {a.get('type')}{a.get('num_bits')} {a.get('strategy')}" if a else ""
    return (f"config group {group!r} (weights {w.get('type')}{w.get('num_bits')} "
            f"{w.get('strategy')}{act})")


class CompressedTensorsMethod(PerLayerFormatMethod):
    """compressed-tensors FP8 / INT8 W8A8 / W4A16 / W8A16 checkpoints, dispatched per layer.

    Raises:
        ValueError: for a scheme or format we do not implement, naming its group.
    """

    name = "compressed-tensors"

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        cfg = self.checkpoint_config
        if cfg.get("quant_method") != "compressed-tensors":
            raise ValueError(
                f"--quantization compressed-tensors needs a compressed-tensors checkpoint "
                f"(quantization_config quant_method 'compressed-tensors'), this one has "
                f"{cfg.get('quant_method')!r}")
        if cfg.get("sparsity_config"):
            raise ValueError("compressed-tensors sparsity (sparsity_config) is not supported")
        if cfg.get("transform_config"):
            raise ValueError("compressed-tensors transforms (transform_config) are not supported")
        self.ignore = [str(p) for p in (cfg.get("ignore") or [])]
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        platform = current_platform_or_none(self.options)
        fmt = str(cfg.get("format") or "")
        self.groups: list[tuple[list[str], LinearFormat]] = []
        for group, scheme in groups.items():
            targets = [str(t) for t in scheme.get("targets") or []]
            self.groups.append((targets, self._format(group, scheme, scheme.get("format") or fmt,
                                                      platform)))
        self._dense = DenseFormat()

    def _format(self, group: str, scheme: dict[str, Any], fmt: str, platform: Any) -> LinearFormat:
        label = _scheme_label(group, scheme)
        weights = scheme.get("weights")
        acts = scheme.get("input_activations")
        if weights is None:
            raise ValueError(f"compressed-tensors {label}: groups without weight quantization "
                             f"are not supported")
        if scheme.get("output_activations"):
            raise ValueError(f"compressed-tensors {label}: output activation quantization is "
                             f"not supported")
        kind, bits = weights.get("type"), int(weights.get("num_bits", 0))
        strategy = str(weights.get("strategy"))
        if kind == "int" and acts is None and fmt in _INT_FORMATS and bits in (4, 8):
            return CtPackedIntFormat(weights, platform, self.dequantize_at_load)
        if kind == "int" and bits == 8 and acts is not None and fmt in _INT8_FORMATS:
            if not weights.get("symmetric", True):
                raise ValueError(f"compressed-tensors {label}: asymmetric INT8 weights are not "
                                 f"supported")
            if not (acts.get("type") == "int" and int(acts.get("num_bits", 0)) == 8
                    and acts.get("dynamic") and acts.get("strategy") == "token"
                    and acts.get("symmetric", True)):
                raise ValueError(f"compressed-tensors {label}: INT8 activations must be "
                                 f"dynamic, symmetric, per token")
            return CtInt8Format(strategy, platform)
        if kind == "float" and bits == 8 and fmt in _FP8_FORMATS:
            fp8_acts = acts is None or (acts.get("type") == "float"
                                        and int(acts.get("num_bits", 0)) == 8)
            if not fp8_acts:
                raise ValueError(f"compressed-tensors {label}: FP8 weights need FP8 or no "
                                 f"activation quantization")
            if strategy == "block":
                if acts is not None and not acts.get("dynamic"):
                    raise ValueError(f"compressed-tensors {label}: block FP8 needs dynamic "
                                     f"activations")
                options = {**self.options, "dequantize_at_load": self.dequantize_at_load}
                return CtFp8BlockFormat(list(weights.get("block_structure") or []), options)
            return CtFp8Format(strategy, acts, platform, self.dequantize_at_load)
        raise ValueError(f"compressed-tensors {label} in format {fmt!r} is not supported "
                         f"(supported: FP8 tensor/channel/block, INT8 W8A8 channel, "
                         f"pack-quantized int4/int8 weight-only)")

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return (f"W4A16/W8A16: {int_weight_only_kernel_name(platform)}; INT8 W8A8: "
                f"{INT8_KERNEL_NAMES[choose_int8_kernel(platform)]}; FP8: "
                f"{fp8_kernel_description(platform)}")

    def format_for(self, prefix: str, output_sizes: list[int]) -> LinearFormat:
        names = checkpoint_module_names(prefix)
        chosen = {id(self._format_of(name)): self._format_of(name) for name in names}
        if len(chosen) > 1:
            raise ValueError(f"{prefix} fuses layers ({', '.join(names)}) that the "
                             f"compressed-tensors config quantizes differently; they must share "
                             f"one scheme")
        return chosen.popitem()[1]

    def _format_of(self, name: str) -> LinearFormat:
        if any(matches_target(name, p) for p in self.ignore):
            return self._dense
        for targets, fmt in self.groups:
            if any(t == "Linear" or matches_target(name, t) for t in targets):
                return fmt
        return self._dense
