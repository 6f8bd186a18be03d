"""``inference-engine quantize``: a 16/32-bit HF checkpoint folder in, a quantized one out.

Reads every safetensors shard of ``MODEL``, quantizes the tensors the
method's exporter selects (decoder linear weights), copies the rest
unchanged, keeps the shard split (and rewrites the index), adds
``quantization_config`` to ``config.json`` and copies every other file
(tokenizer, generation config, chat template). The engine then serves the
output folder with no flag: the config names the method.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from inference_engine_quant.quantize_exporters import QuantExporter, get_exporter

__all__ = ["QuantizeResult", "quantize_checkpoint", "run_quantize_command"]

_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class QuantizeResult:
    """What one run wrote."""

    out_dir: Path
    quantized_tensors: int
    copied_tensors: int
    bytes_in: int
    bytes_out: int


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / _INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise ValueError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return [model_dir / n for n in names]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{model_dir} has no *.safetensors files (quantize reads safetensors "
                         f"checkpoints only)")
    return shards


def _check_source(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise ValueError(f"MODEL {model_dir} is not a folder (expected a Hugging Face checkpoint)")
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise ValueError(f"{model_dir} has no config.json")
    config = json.loads(config_path.read_text())
    existing = config.get("quantization_config")
    if existing:
        raise ValueError(f"{model_dir} is already quantized (quantization_config.quant_method = "
                         f"{existing.get('quant_method')!r}); quantize a bf16/fp16/fp32 checkpoint")
    return config


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quantize_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    method: str,
    layout: str | None = None,
    overwrite: bool = False,
    show_progress: bool = True,
) -> QuantizeResult:
    """Write ``model_dir`` quantized with ``method`` into ``out_dir``.

    Args:
        model_dir: Hugging Face folder (config.json + safetensors), unquantized.
        out_dir: output folder; must not exist or be empty unless ``overwrite``.
        method: an exporter name (``fp8``, ``fp8-block``, ...).
        layout: ``"KN"`` (the engine's, default for FP8) or ``"NK"`` (HF/vLLM).
        overwrite: replace an existing non-empty ``out_dir``.
        show_progress: a progress bar over tensors.

    Raises:
        ValueError: bad paths, an already-quantized source, an unknown method or layout.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    exporter: QuantExporter = get_exporter(method)
    layout = (layout or exporter.layouts[0]).upper()
    if layout not in exporter.layouts:
        raise ValueError(f"--layout {layout!r} is not available for --method {method}; "
                         f"choose from {', '.join(exporter.layouts)}")
    config = _check_source(model_dir)
    shards = _shards(model_dir)
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must differ from MODEL")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise ValueError(f"--out {out_dir} exists and is not empty (pass --overwrite)")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    total = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            total += len(list(f.keys()))
    bar = tqdm(total=total, desc=f"Quantizing ({method})", unit="tensor", disable=not show_progress)
    weight_map: dict[str, str] = {}
    quantized = copied = bytes_in = bytes_out = 0
    for shard in shards:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                bytes_in += _bytes(tensor)
                if exporter.selects(name, tensor):
                    if not tensor.is_floating_point() or tensor.element_size() == 1:
                        raise ValueError(f"{name}: expected a 16/32-bit float weight, got "
                                         f"{tensor.dtype}")
                    module = name[: -len(".weight")]
                    for suffix, out in exporter.quantize_weight(module, tensor, layout).items():
                        tensors[f"{module}.{suffix}"] = out
                    quantized += 1
                else:
                    tensors[name] = tensor
                    copied += 1
                bar.update(1)
        for name, tensor in tensors.items():
            weight_map[name] = shard.name
            bytes_out += _bytes(tensor)
        save_file(tensors, str(out_dir / shard.name), metadata={"format": "pt"})
    bar.close()
    if quantized == 0:
        raise ValueError(f"{model_dir}: no decoder linear weights (model.layers.N.*_proj.weight) "
                         f"found to quantize")

    for item in model_dir.iterdir():
        if item.suffix == ".safetensors" or item.name in (_INDEX, "config.json"):
            continue
        target = out_dir / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target)
    config["quantization_config"] = exporter.quantization_config(layout)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (model_dir / _INDEX).exists():
        index = {"metadata": {"total_size": bytes_out},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if exporter.extra_files is not None:
        for file_name, text in exporter.extra_files(layout).items():
            (out_dir / file_name).write_text(text)
    return QuantizeResult(out_dir, quantized, copied, bytes_in, bytes_out)


def run_quantize_command(model: str, method: str, out: str, layout: str | None,
                         overwrite: bool) -> int:
    """The ``quantize`` command: run, print a summary, return the exit status (2 on bad input)."""
    import sys

    try:
        result = quantize_checkpoint(model, out, method, layout=layout, overwrite=overwrite)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mib = 1 << 20
    print(f"wrote {result.out_dir}: {result.quantized_tensors} weights quantized ({method}), "
          f"{result.copied_tensors} tensors copied; {result.bytes_in / mib:.2f} MiB -> "
          f"{result.bytes_out / mib:.2f} MiB")
    return 0
