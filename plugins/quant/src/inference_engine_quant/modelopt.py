"""``modelopt``: NVIDIA ModelOpt checkpoints, one format or mixed precision per layer.

The checkpoint says how it was quantized either in ``hf_quant_config.json``
(``{"producer": ..., "quantization": {"quant_algo": ..., "exclude_modules": [...]}}``,
which the loader folds into a ``quant_method: "modelopt"`` config) or, in
newer exports, in ``config.json``'s ``quantization_config`` (``quant_method:
"modelopt"``, ``quant_algo``, ``ignore``). quant-formats.md section 8.

``quant_algo`` picks the format of every quantized linear layer:

* ``NVFP4`` (``group_size`` 16): :class:`~inference_engine_quant.nvfp4.Nvfp4Format`;
* ``FP8`` (per-tensor ``weight_scale`` and static ``input_scale``): the ``fp8``
  method's per-tensor path;
* ``MXFP8``: :class:`~inference_engine_quant.mxfp8.Mxfp8Format`;
* ``MIXED_PRECISION``: ``quantized_layers`` maps checkpoint module names to
  ``{"quant_algo": ..., "group_size": ...}``; a layer not in the map is
  left unquantized.

Modules matching ``exclude_modules`` / ``ignore`` (exact names or ``*``
wildcards) stay unquantized. One method instance dispatches per layer
prefix; fused layers (q/k/v, gate/up) need all their parts in one format.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inference_engine_quant.fp8 import Fp8Method, checkpoint_module_names, current_platform_or_none
from inference_engine_quant.fp8_linear import fp8_kernel_description
from inference_engine_quant.mx_linear import (
    DenseFormat,
    LinearFormat,
    PerLayerFormatMethod,
    fp4_kernel_name,
    matches_module,
)
from inference_engine_quant.mxfp8 import Mxfp8Format
from inference_engine_quant.nvfp4 import Nvfp4Format

__all__ = ["ModelOptFp8Format", "ModelOptMethod", "modelopt_delegate", "modelopt_settings"]

SUPPORTED_ALGOS = ("NVFP4", "FP8", "MXFP8")
_GROUP_SIZES = {"NVFP4": 16, "MXFP8": 32}


def modelopt_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The ``quantization`` section of a ModelOpt config, wherever the export put it.

    Accepts ``hf_quant_config.json``'s shape (keys under ``"quantization"``) or
    ``config.json``'s flat ``quantization_config``; flat keys win.
    """
    nested = config.get("quantization")
    settings = dict(nested) if isinstance(nested, dict) else {}
    settings.update({k: v for k, v in config.items() if k != "quantization"})
    return settings


class ModelOptFp8Format(LinearFormat):
    """ModelOpt FP8: ``weight`` F8_E4M3, scalar ``weight_scale`` and ``input_scale``.

    The same tensors as a static per-tensor ``fp8`` checkpoint, so the ``fp8``
    method's per-tensor path does the work.
    """

    name = "fp8"

    def __init__(self, **options: Any) -> None:
        self._method = Fp8Method({"quant_method": "fp8", "activation_scheme": "static"}, **options)

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        self._method.create_weights(layer, prefix, input_size, output_sizes, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._method.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._method.apply(layer, x, bias)


class ModelOptMethod(PerLayerFormatMethod):
    """ModelOpt NVFP4 / FP8 / MXFP8 / MIXED_PRECISION checkpoints, dispatched per layer.

    Raises:
        ValueError: for an unsupported ``quant_algo`` or group size, or a fused
            layer whose parts the map gives different formats.
    """

    name = "modelopt"
    # NVFP4 (16-value blocks, scalar global scales), FP8 per-tensor and MXFP8 (32-value
    # blocks) layers are cut with their rows / whole blocks of K; experts are not (FusedMoE).
    supports_tensor_parallel = True

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        settings = modelopt_settings(self.checkpoint_config)
        algo = str(settings.get("quant_algo") or "").upper()
        if algo not in SUPPORTED_ALGOS + ("MIXED_PRECISION",):
            raise ValueError(
                f"ModelOpt quant_algo {settings.get('quant_algo')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ALGOS + ('MIXED_PRECISION',))}"
            )
        self.algo = algo
        self.excluded = [str(p) for key in ("exclude_modules", "ignore")
                         for p in (settings.get(key) or [])]
        layers = settings.get("quantized_layers") or {}
        if algo == "MIXED_PRECISION" and not layers:
            raise ValueError("ModelOpt MIXED_PRECISION config has no quantized_layers map")
        self.layer_algos: dict[str, str] = {}
        for name, spec in layers.items():
            layer_algo = str((spec or {}).get("quant_algo") or "").upper()
            self._check_algo(layer_algo, (spec or {}).get("group_size"),
                             f"quantized_layers[{name!r}]")
            self.layer_algos[name] = layer_algo
        if algo != "MIXED_PRECISION":
            self._check_algo(algo, settings.get("group_size"), "quant_algo")
        platform = current_platform_or_none(self.options)
        self._formats: dict[str, LinearFormat] = {
            "NVFP4": Nvfp4Format(False, self.dequantize_at_load, platform),
            "FP8": ModelOptFp8Format(**options),
            "MXFP8": Mxfp8Format(False, self.dequantize_at_load, platform=platform),
        }
        self._dense = DenseFormat()

    @staticmethod
    def _check_algo(algo: str, group_size: Any, where: str) -> None:
        if algo not in SUPPORTED_ALGOS:
            raise ValueError(f"ModelOpt {where}: quant_algo {algo!r} is not supported "
                             f"(supported per layer: {', '.join(SUPPORTED_ALGOS)})")
        expected = _GROUP_SIZES.get(algo)
        if group_size is not None and expected is not None and int(group_size) != expected:
            raise ValueError(f"ModelOpt {where}: {algo} needs group_size {expected}, "
                             f"got {group_size}")

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return (f"NVFP4: {fp4_kernel_name(platform, 'NVFP4')}; FP8: "
                f"{fp8_kernel_description(platform, blockwise=False)}; MXFP8: torch dequantize "
                f"+ matmul (reference)")

    def algo_for(self, prefix: str) -> str | None:
        """The quant_algo of the layer ``prefix``, or None when it stays unquantized.

        Raises:
            ValueError: when fused parts map to different algorithms.
        """
        if matches_module(prefix, self.excluded):
            return None
        if self.algo != "MIXED_PRECISION":
            return self.algo
        names = checkpoint_module_names(prefix)
        algos = {self.layer_algos.get(name) for name in names}
        if len(algos) > 1:
            listing = ", ".join(f"{n}: {self.layer_algos.get(n) or 'unquantized'}" for n in names)
            raise ValueError(f"{prefix} fuses layers quantized differently ({listing}); "
                             f"they must share one format")
        return algos.pop()

    def format_for(self, prefix: str, output_sizes: list[int]) -> LinearFormat:
        algo = self.algo_for(prefix)
        return self._dense if algo is None else self._formats[algo]


def modelopt_delegate(method: PerLayerFormatMethod, algo: str) -> ModelOptMethod | None:
    """For an online method given a checkpoint: the ModelOpt method when the
    checkpoint is ModelOpt ``algo`` (the same per-layer logic), None when it
    is unquantized.

    Raises:
        ValueError: for a checkpoint quantized any other way.
    """
    quant_method = method.checkpoint_config.get("quant_method")
    if quant_method is None:
        return None
    flag = f"--quantization {method.name}"
    if quant_method != "modelopt":
        raise ValueError(f"{flag} cannot run a checkpoint already quantized with "
                         f"{quant_method!r}; drop the flag to use the checkpoint's own method")
    found = str(modelopt_settings(method.checkpoint_config).get("quant_algo", "")).upper()
    if found != algo:
        raise ValueError(f"{flag} cannot run a ModelOpt {found} checkpoint; "
                         f"drop the flag to use the checkpoint's own method")
    return ModelOptMethod(method.checkpoint_config, **method.options)
