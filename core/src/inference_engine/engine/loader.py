"""Turn a checkpoint path into a loaded model, its config, tokenizer and EOS ids."""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from inference_engine.config import ModelConfig, QuantConfig
from inference_engine.engine.hub import resolve_model_path
from inference_engine.interfaces.model import CausalLM, ModelContext
from inference_engine.interfaces.platform import Platform
from inference_engine.layers.cpu_gemv import allow_bf16_gemm
from inference_engine.plugins import get_plugins

__all__ = ["LoadedModel", "load_model", "compute_dtype", "requested_dtype"]

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: Any
    tokenizer: Any
    eos_token_ids: set[int]
    dtype: torch.dtype
    max_model_len: int
    architecture: str
    # The generation config whose sampling values are request defaults ({}: none), picked by
    # --generation-config (EOS ids always come from the checkpoint's own).
    generation_config: dict[str, Any] = field(default_factory=dict)


def requested_dtype(requested: str, hf_config: Any, platform: Platform) -> torch.dtype:
    """The dtype asked for (``auto``: the config's); float16 becomes bfloat16 on CPU,
    where fp16 math is ~1000x slower."""
    if requested == "auto":
        raw = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(raw, str):
            raw = DTYPE_NAMES.get(raw, torch.float32)
        dtype = raw if isinstance(raw, torch.dtype) else torch.float32
    else:
        dtype = DTYPE_NAMES[requested]
    if dtype == torch.float16 and platform.device_type == "cpu":
        warnings.warn(
            "float16 is very slow on CPU; computing in bfloat16 instead", stacklevel=2
        )
        dtype = torch.bfloat16
    return dtype


def kv_cache_dtype(option: str, asked: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``--kv-cache-dtype option``.

    ``auto`` keeps the checkpoint's precision as asked: a bfloat16 model that
    the CPU computes in float32 caches K/V in bfloat16, as the model itself
    (and transformers, vLLM) would, which halves what decode attention reads;
    otherwise the compute dtype.
    """
    if option == "auto":
        return asked if asked == torch.bfloat16 and compute == torch.float32 else compute
    if option in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[option]


def attention_backend_candidates(name: str, platform: Platform) -> list[type]:
    """The backend classes layers may use: ``name``'s alone, or for ``auto`` the platform's
    ``attention_backends()`` that are registered, best first (each layer takes the first
    that supports it: head size, sinks, sliding window, cache dtype).

    Raises:
        UnknownNameError: ``name`` is not a registered backend.
        ValueError: ``auto`` and the platform lists no registered backend.
    """
    registry = get_plugins().registry
    if name != "auto":
        return [registry.resolve("attention_backends", name)]
    registered = set(registry.names("attention_backends"))
    names = [n for n in platform.attention_backends() if n in registered]
    if not names:
        raise ValueError(f"attention_backend=auto: the {platform.name} platform lists "
                         f"{platform.attention_backends()}, none of them registered")
    return [registry.resolve("attention_backends", n) for n in names]


def compute_dtype(dtype: torch.dtype, platform: Platform) -> torch.dtype:
    """The dtype the platform computes a ``dtype`` model in."""
    compute = platform.compute_dtype(dtype)
    if compute != dtype:
        logger.info(
            "%s computes %s models in %s (their weights are exact in it)",
            platform.device_name(), dtype, compute,
        )
    return compute


def detect_format(path: str) -> str:
    plugins = get_plugins()
    name = plugins.hook.ie_detect_weight_format(path=path)
    if name is None:
        raise ValueError(
            f"cannot tell the weight format of {path!r}: expected a folder with config.json and "
            f"*.safetensors, or a .gguf file (registered formats: "
            f"{', '.join(plugins.registry.names('weight_formats'))})"
        )
    return name


def _hf_config(config_dict: dict[str, Any], path: str = "",
               trust_remote_code: bool = False,
               overrides: dict[str, Any] | None = None) -> Any:
    """The transformers config of ``config_dict`` with ``overrides`` (--hf-overrides) applied."""
    overrides = overrides or {}
    config = _checkpoint_config({**config_dict, **overrides}, path, trust_remote_code)
    for key, value in overrides.items():  # remote-code configs read the file, not the dict
        setattr(config, key, value)
    return config


def _checkpoint_config(config_dict: dict[str, Any], path: str,
                       trust_remote_code: bool) -> Any:
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config_dict.get("model_type")
    if not model_type:
        raise ValueError("config.json has no model_type")
    custom = (config_dict.get("auto_map") or {}).get("AutoConfig")
    if custom and model_type not in CONFIG_MAPPING:
        # The config class is code shipped in the model folder: run only when trusted.
        if not trust_remote_code:
            raise ValueError(f"{path}: config.json maps model_type {model_type!r} to code in "
                             f"the model folder ({custom}); pass --trust-remote-code "
                             f"(trust_remote_code=True) to run it")
        return AutoConfig.from_pretrained(path, trust_remote_code=True)
    rest = {k: v for k, v in config_dict.items() if k != "model_type"}
    # transformers writes non-finite floats as {"__float__": "Infinity"} (Nemotron-H's
    # time_step_limit) and decodes them when it reads a config file; so do we.
    rest = PretrainedConfig._decode_special_floats(rest)
    try:
        return AutoConfig.for_model(model_type, **rest)
    except ValueError as exc:
        raise ValueError(f"config.json: transformers does not know model_type {model_type!r}: {exc}") from exc


def _quant_method(quant: QuantConfig, hf_config: Any, path: str = "",
                  platform: Platform | None = None) -> Any:
    registry = get_plugins().registry
    checkpoint_cfg = getattr(hf_config, "quantization_config", None)
    if checkpoint_cfg is not None and not isinstance(checkpoint_cfg, dict):
        checkpoint_cfg = checkpoint_cfg.to_dict()
    modelopt_file = os.path.join(path, "hf_quant_config.json")
    if checkpoint_cfg is None and os.path.isfile(modelopt_file):
        # ModelOpt exports may describe their quantization only in this file.
        with open(modelopt_file) as f:
            checkpoint_cfg = {"quant_method": "modelopt", **json.load(f)}
    name = quant.method or (checkpoint_cfg or {}).get("quant_method") or "unquantized"
    cls = registry.resolve("quantization", name)
    unknown = sorted(set(quant.options) - set(cls.option_names))
    if unknown:
        takes = ", ".join(sorted(cls.option_names)) or "none"
        raise ValueError(f"quantization method {name!r} has no option {unknown[0]!r} "
                         f"(--quant-option; it takes: {takes})")
    return cls(checkpoint_cfg, dequantize_at_load=quant.dequantize_at_load, platform=platform,
               **quant.options)


def load_model(
    model_config: ModelConfig,
    quant: QuantConfig,
    platform: Platform,
    show_progress: bool = True,
) -> LoadedModel:
    """Load weights into the registered architecture.

    Raises:
        UnknownNameError / RemovedArchitectureError: for the architecture.
        ValueError: missing/unexpected tensors or shape mismatches, by name.
    """
    registry = get_plugins().registry
    path = resolve_model_path(model_config.model)
    fmt = registry.resolve("weight_formats", detect_format(path))(path)
    hf_config = _hf_config(fmt.load_config(), path, model_config.trust_remote_code,
                           model_config.hf_overrides)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"config.json of {path} lists no architectures")
    architecture = architectures[0]
    model_cls = registry.resolve("models", architecture)
    asked = requested_dtype(model_config.dtype, hf_config, platform)
    dtype = compute_dtype(asked, platform)
    backends = attention_backend_candidates(model_config.attention_backend, platform)
    device = platform.device()
    # Whisper names its decoder's limit max_target_positions.
    max_len = (model_config.max_model_len or getattr(hf_config, "max_position_embeddings", None)
               or getattr(hf_config, "max_target_positions", None) or 2048)
    ctx = ModelContext(
        hf_config=hf_config,
        dtype=dtype,
        quant_method=_quant_method(quant, hf_config, path, platform),
        attention_backend=backends[0],
        attention_backend_candidates=tuple(backends) if len(backends) > 1 else (),
        device=device,
        max_model_len=int(max_len),
        kv_cache_dtype=kv_cache_dtype(model_config.kv_cache_dtype, asked, dtype),
    )
    _check_parallel_quant(ctx.quant_method)
    with torch.device(device):
        model = model_cls(ctx)
    model.eval()
    names = fmt.tensor_names()
    weights = fmt.iter_weights()
    if show_progress:
        weights = tqdm(weights, total=len(names), desc="Loading weights", unit="tensor",
                       disable=len(names) < 64, leave=False)
    with torch.no_grad():
        model.load_weights(weights)
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
            elif hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        ctx.quant_method.process_model_after_loading(model)
        if asked == torch.bfloat16 and dtype == torch.float32:
            allow_bf16_gemm(model)  # bf16 was asked for: bf16 GEMMs are as precise as that
    tokenizer = None if model_config.tokenizer else fmt.load_tokenizer()
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer or path, trust_remote_code=model_config.trust_remote_code)
    checkpoint_generation_config = fmt.generation_config()
    eos = _eos_ids(checkpoint_generation_config, hf_config, tokenizer)
    return LoadedModel(model, hf_config, tokenizer, eos, dtype, int(max_len), architecture,
                       sampling_generation_config(model_config.generation_config,
                                                  checkpoint_generation_config))


def _check_parallel_quant(method: Any) -> None:
    """Quantized layers do not shard their scales yet: refuse them under TP/EP by name.

    Raises:
        ValueError: a quantized checkpoint (or --quantization) with more than one rank.
    """
    from inference_engine.distributed.parallel_state import parallel_state

    state = parallel_state()
    name = getattr(method, "name", type(method).__name__)
    if (state.tp.size > 1 or state.ep.size > 1) and not type(method).__dict__.get(
            "supports_tensor_parallel", False):
        raise ValueError(f"quantization {name!r} under tensor/expert parallelism is not "
                         f"implemented (its scales are not sharded with the weights); run it "
                         f"on one device")


def sampling_generation_config(choice: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The generation config whose sampling values are request defaults
    (``--generation-config``, as vLLM): ``auto`` the checkpoint's, ``vllm`` none, else
    the ``generation_config.json`` in the folder ``choice``.

    Raises:
        ValueError: the folder has no readable ``generation_config.json``.
    """
    if choice == "auto":
        return checkpoint
    if choice == "vllm":
        return {}
    file = os.path.join(choice, "generation_config.json")
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config {choice}: cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--generation-config {choice}: {file} is not a JSON object")
    return data


def _eos_ids(generation_config: dict[str, Any], hf_config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (generation_config.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
        if ids:
            break
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
