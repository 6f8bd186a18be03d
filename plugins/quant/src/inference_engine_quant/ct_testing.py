"""Test helper: compressed-tensors checkpoints written by the ``compressed-tensors`` library itself.

Kept in the package (tests cannot import each other under
``--import-mode=importlib``). Nothing here is used at run time, and the
library is a test dependency only.

The library attaches a scheme to each targeted ``Linear``
(``apply_quantization_config``); the weight's quantization parameters come
from the library's ``calculate_qparams`` over the weight's min/max per the
scheme's strategy (what LLM Compressor's min-max observer feeds it); the
library's ``ModelCompressor`` then writes the checkpoint's tensors and
``quantization_config``. Its dequantized twin holds the library's
``fake_quantize`` of each weight.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["weight_min_max", "write_ct_checkpoint"]


def weight_min_max(w: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-strategy min and max of ``w [N, K]``, shaped as the scheme's scale."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    w = w.float()
    if strategy == "tensor":
        return w.min().reshape(1), w.max().reshape(1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        return g.amin(-1), g.amax(-1)
    if strategy == "block":
        bn, bk = args.block_structure
        n, k = w.shape
        pn, pk = -(-n // bn) * bn - n, -(-k // bk) * bk - k
        lo = F.pad(w, (0, pk, 0, pn), value=float("inf"))
        hi = F.pad(w, (0, pk, 0, pn), value=float("-inf"))
        shape = (-(-n // bn), bn, -(-k // bk), bk)
        return lo.reshape(shape).amin((1, 3)), hi.reshape(shape).amax((1, 3))
    raise ValueError(f"no min/max rule for strategy {strategy!r}")


def write_ct_checkpoint(src: str | Path, quant_dir: str | Path, dequant_dir: str | Path,
                        scheme: Any, ignore: list[str] | None = None,
                        quantization_format: str | None = None) -> Any:
    """Quantize the transformers model at ``src`` with ``scheme`` and save it twice.

    Args:
        scheme: a preset name (``"W4A16"``, ``"FP8_DYNAMIC"``, ...) or a
            ``QuantizationScheme``; targets every ``Linear``.
        ignore: module names/patterns left dense (default ``["lm_head"]``).
        quantization_format: force the format (else the library infers it).

    Returns:
        The quantized in-memory model before compression (runs the library's own
        quantized forward: fake-quantized weights and activations).
    """
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    src, quant_dir, dequant_dir = Path(src), Path(quant_dir), Path(dequant_dir)
    if isinstance(scheme, str):
        scheme = preset_name_to_scheme(scheme, ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                ignore=ignore if ignore is not None else ["lm_head"])
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    dense = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    apply_quantization_config(model, config)
    dense_modules = dict(dense.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None or qscheme.weights is None:
                continue
            args = qscheme.weights
            lo, hi = weight_min_max(module.weight, args)
            scale, zero_point = calculate_qparams(lo, hi, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(
                    zero_point.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
            dq = fake_quantize(module.weight, module.weight_scale,
                               getattr(module, "weight_zero_point", None), args)
            dense_modules[name].weight.data.copy_(dq)
    for out in (quant_dir, dequant_dir):
        shutil.copytree(src, out, dirs_exist_ok=True)
        (out / "model.safetensors").unlink()
    dense.save_pretrained(dequant_dir)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format)
    compressor.compress_model(model)
    model.save_pretrained(quant_dir)
    compressor.update_config(str(quant_dir))
    return model
