"""Reading a PEFT LoRA adapter and checking it against the base model.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``...) and ``adapter_model.safetensors`` with, per adapted
module, ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``; the module's output gains
``scaling * x A^T B^T`` with ``scaling = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` under rsLoRA). Modules are named as in the transformers model
(``q_proj``, ``gate_proj``...); :func:`lora_targets` maps those names onto our
fused layers' parts. Everything wrong with an adapter is found here, before
any request uses it, so a bad adapter fails its own request only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inference_engine.layers.linear import LinearBase
from inference_engine.layers.weights import STACKED_PARAMS
from inference_engine.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRATarget", "SUPPORTED_TARGETS", "load_adapter",
           "lora_targets"]

# The transformers module names an adapter may target: attention and MLP projections.
SUPPORTED_TARGETS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})

# ``base_model.model.<module>.lora_A[.<adapter name>].weight``
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot run on this model; the message names the adapter and why."""


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """Where one transformers module lives in our model: a linear layer and one of its parts."""

    layer: LinearBase
    # Index of the part in ``layer.output_sizes`` (q/k/v, gate/up; 0 when not fused).
    part: int
    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """An adapter checked against the model, in host memory.

    ``weights`` maps a transformers module name to ``(A [r, in], B [out, r])`` with
    the scaling already multiplied into ``B``.
    """

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """Every module an adapter may target, by its transformers name
    (``model.layers.0.self_attn.q_proj`` -> part ``"q"`` of ``...qkv_proj``)."""
    fused_parts: dict[str, list[tuple[str, object]]] = {}
    for ckpt, (fused, shard) in STACKED_PARAMS.items():
        fused_parts.setdefault(fused, []).append((ckpt, shard))
    targets: dict[str, LoRATarget] = {}
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        parent, _, base = module.prefix.rpartition(".")
        names: list[tuple[str, int]] = []
        if module.is_fused:
            for ckpt, shard in fused_parts.get(base, []):
                if shard in module.shard_ids:
                    names.append((ckpt, module.shard_ids.index(shard)))
        else:
            names.append((base, 0))
        for name, part in names:
            if name in SUPPORTED_TARGETS:
                full = f"{parent}.{name}" if parent else name
                targets[full] = LoRATarget(module, part, module.input_size,
                                           module.output_sizes[part])
    return targets


def _read_config(request: LoRARequest, where: Path) -> dict:
    path = where / "adapter_config.json"
    if not path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: no adapter_config.json in "
                               f"{where}")
    config = json.loads(path.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: peft_type "
                               f"{config.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA", "modules_to_save": "modules_to_save (full copies of base modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: bias={config['bias']!r} is "
                               f"not supported (only 'none')")
    return config


def _check_targets(request: LoRARequest, config: dict) -> None:
    declared = config.get("target_modules")
    if isinstance(declared, list):
        unknown = sorted(set(declared) - SUPPORTED_TARGETS)
        if unknown:
            raise LoRAAdapterError(
                f"LoRA adapter {request.lora_name!r}: unknown target modules {unknown}; "
                f"supported: {sorted(SUPPORTED_TARGETS)}")


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read and check ``request``'s adapter; its tensors come back in ``dtype`` on the host.

    Raises:
        LoRAAdapterError: a missing file, a rank above ``max_rank``, a target module the
            engine does not adapt or the model lacks, a lone ``lora_A``/``lora_B``, a
            declared target with no tensors, or a tensor whose shape is not the base
            model's.
    """
    from safetensors.torch import load_file

    name = request.lora_name
    where = Path(request.lora_path).expanduser()
    if not where.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {where} is not a directory")
    config = _read_config(request, where)
    _check_targets(request, config)
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank "
                               f"({max_rank})")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    file = where / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {where} "
                               f"(only the safetensors format is read)")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: unsupported tensor {key!r}")
        halves.setdefault(match["module"], {})[match["ab"]] = tensor
    if not halves:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: the safetensors file has no tensors")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(halves.items()):
        base = module.rpartition(".")[2]
        if base not in SUPPORTED_TARGETS:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: unknown target module {module!r}; "
                                   f"supported: {sorted(SUPPORTED_TARGETS)}")
        target = targets.get(module)
        if target is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: the base model has no module "
                                   f"{module!r} (an adapter for another model?)")
        missing = {"A", "B"} - set(pair)
        if missing:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: missing tensor "
                                   f"{module}.lora_{missing.pop()}.weight")
        a, b = pair["A"], pair["B"]
        want_a, want_b = (rank, target.in_features), (target.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the base model (rank {rank}) expects {want_a} and {want_b}")
        weights[module] = (a.to(dtype).contiguous(),
                           (b.to(torch.float32) * scaling).to(dtype).contiguous())
    declared = config.get("target_modules")
    if isinstance(declared, list):
        layers = config.get("layers_to_transform")
        expected = [m for m in targets if m.rpartition(".")[2] in declared
                    and (layers is None or _layer_index(m) in _as_list(layers))]
        absent = [m for m in expected if m not in weights]
        if absent:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: missing tensors for "
                                   f"{len(absent)} targeted modules, e.g. {absent[:3]}")
    return LoRAAdapter(request, rank, scaling, weights)


def _layer_index(module: str) -> int | None:
    match = re.search(r"\.layers\.(\d+)\.", module)
    return int(match.group(1)) if match else None


def _as_list(value: int | list[int]) -> list[int]:
    return [value] if isinstance(value, int) else list(value)
