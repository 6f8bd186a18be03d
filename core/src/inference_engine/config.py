"""One :class:`EngineConfig` built once from CLI flags or keyword arguments.

This is the only module that reads environment variables. Validation raises
``ValueError`` naming the flag; nothing here asserts on user input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "QuantConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "api_key_from_env",
    "plugin_filter_from_env",
    "simulated_devices_from_env",
    "visible_devices_from_env",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache element types; "auto" is the checkpoint's dtype as run (see loader.kv_cache_dtype).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3")


def plugin_filter_from_env() -> list[str] | None:
    """``INFERENCE_ENGINE_PLUGINS=a,b`` restricts which plugins load (None: all)."""
    value = os.environ.get("INFERENCE_ENGINE_PLUGINS")
    if value is None or not value.strip():
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def simulated_devices_from_env() -> str | None:
    """``INFERENCE_ENGINE_SIMULATED_DEVICES=h100:2`` describes a simulated machine (None: real).

    For ``env`` and platform selection on machines without the hardware; see
    docs/platforms.md. ``none`` simulates a CPU-only machine.
    """
    value = os.environ.get("INFERENCE_ENGINE_SIMULATED_DEVICES")
    return None if value is None else value.strip()


def visible_devices_from_env(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """The ``*_VISIBLE_DEVICES``-style variables among ``names`` that are set, with values.

    The engine never sets these; when one is set, ``--device-ids`` index the
    devices it leaves visible.
    """
    return [(name, os.environ[name]) for name in names if name in os.environ]


def api_key_from_env() -> str | None:
    """The server's API key from ``INFERENCE_ENGINE_API_KEY``, if set.

    Several keys may be given separated by commas.
    """
    return os.environ.get("INFERENCE_ENGINE_API_KEY") or None


@dataclass
class ServerConfig:
    """The HTTP front end (``inference-engine serve``); the engine has its own config.

    Raises:
        ValueError: ``--enable-auth`` without a key, a bad port, or an unknown
            tool-call streaming mode; the message names the flag.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    # Names the API accepts in ``model``; the first is reported. Default: the model path.
    served_model_names: list[str] = field(default_factory=list)
    # LoRA adapters served as model names (``--lora-modules name=path``): name -> path.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # Accepted bearer keys; non-empty turns auth on.
    api_keys: list[str] = field(default_factory=list)
    enable_auth: bool = False
    enable_cors: bool = False
    cors_allow_origins: list[str] = field(default_factory=lambda: ["*"])
    cors_allow_methods: list[str] = field(default_factory=lambda: ["*"])
    cors_allow_headers: list[str] = field(default_factory=lambda: ["*"])
    cors_allow_credentials: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_streaming: str = "incremental"
    # Chat template text that replaces the tokenizer's (``--chat-template``); None: its own.
    chat_template: str | None = None
    # Render a chat request's own ``chat_template`` (code run on the server; vLLM's
    # --trust-request-chat-template). Off: such a request is a 400 naming the flag.
    trust_request_chat_template: bool = False
    # Also expose the metrics under vLLM's names (``vllm:`` prefix) for existing dashboards.
    vllm_metric_names: bool = False
    # Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted.
    shutdown_timeout: float = 30.0
    # Speech endpoints: the largest audio upload (MiB; vLLM's default 25) and the longest
    # audio (seconds) a transcription takes.
    max_audio_file_size_mb: float = 25.0
    max_audio_seconds: float = 1800.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        self.api_keys = [k for k in self.api_keys if k]
        if self.enable_auth and not self.api_keys:
            raise ValueError("--enable-auth needs at least one key: pass --api-key KEY or set "
                             "INFERENCE_ENGINE_API_KEY")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0-65535, got {self.port}")
        if self.tool_call_streaming not in ("incremental", "whole"):
            raise ValueError("--tool-call-streaming must be incremental or whole, got "
                             f"{self.tool_call_streaming!r}")
        if not self.max_audio_file_size_mb > 0:
            raise ValueError(f"--max-audio-file-size-mb must be positive, got "
                             f"{self.max_audio_file_size_mb}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"--max-audio-seconds must be positive, got {self.max_audio_seconds}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be non-negative, got "
                             f"{self.shutdown_timeout}")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)


@dataclass
class ModelConfig:
    """Which checkpoint to run and how to hold its weights."""

    # Model folder (HF layout) or a single weights file (e.g. .gguf).
    model: str
    # Tokenizer folder; defaults to the model folder.
    tokenizer: str | None = None
    # Where request sampling defaults come from (vLLM's --generation-config): "auto" the
    # checkpoint's generation_config.json, "vllm" none, else a folder holding one.
    generation_config: str = "auto"
    # Run configuration code the model folder ships (config.json ``auto_map``), as vLLM's
    # --trust-remote-code; without it such a model is refused by name.
    trust_remote_code: bool = False
    # "auto" (the checkpoint's torch_dtype), "float32", "bfloat16" or "float16".
    dtype: str = "auto"
    # Longest sequence (prompt + output) in tokens; None: the model's own limit.
    max_model_len: int | None = None
    # Attention backend name as registered ("triton", "cpu_paged", "torch_sdpa"), or "auto":
    # the first of the platform's ``attention_backends()`` that supports each layer.
    attention_backend: str = "auto"
    # KV cache element type: "auto", "float32", "bfloat16" or "fp8" (e4m3, per-tensor scales).
    kv_cache_dtype: str = "auto"
    # Never capture CUDA/HIP graphs: every step runs eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # Base seed for requests that set no seed of their own.
    seed: int = 0
    # Values that replace the checkpoint's config.json entries before the model is built
    # (vLLM's --hf-overrides), e.g. {"indexer_dtype": "fp8"}.
    hf_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.hf_overrides, dict) or not all(
                isinstance(k, str) for k in self.hf_overrides):
            raise ValueError("--hf-overrides must be a JSON object of config keys, got "
                             f"{self.hf_overrides!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(
                self.generation_config):
            raise ValueError("--generation-config must be auto, vllm or a folder holding "
                             f"generation_config.json, got {self.generation_config!r}")


@dataclass
class CacheConfig:
    """Paged KV cache sizing."""

    # Tokens per KV block.
    block_size: int = 16
    # Bytes for the KV pool; None: sized from gpu_memory_utilization on platforms that can
    # profile device memory, else a quarter of free memory capped at 4 GiB.
    kv_cache_memory: int | None = None
    # Fraction of the device's memory this engine may use in all (weights, activations,
    # graphs, KV pool); the KV pool gets what a profiling forward leaves.
    gpu_memory_utilization: float = 0.9
    # Reuse full blocks across requests by chained block hash.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    # Most requests in one step; None: the platform's default (256 on GPUs, 128 on CPU).
    max_num_seqs: int | None = None
    # Token budget of one step (decodes + prefill chunks).
    max_num_batched_tokens: int = 2048
    # Split long prompts across steps; when off a prompt must fit the budget whole.
    enable_chunked_prefill: bool = True
    # Launch step N+1 before step N's sampled ids are read back (vLLM's async scheduling);
    # None: where the platform says it pays (devices that run asynchronously to the host).
    async_scheduling: bool | None = None
    # Greedy decode steps one engine step may run for a lone running request (vLLM's former
    # multi-step scheduling; engine/multi_step.py): a window of up to this many tokens in
    # one call where the model has one (the CPU C++ decode step). 1: one step at a time.
    # 8 by measurement (docs/benchmarks.md, "Multi-step greedy decode").
    num_scheduler_steps: int = 8

    def __post_init__(self) -> None:
        if self.num_scheduler_steps < 1:
            raise ValueError(
                f"--num-scheduler-steps must be at least 1, got {self.num_scheduler_steps}")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass
class ParallelConfig:
    """Devices and parallelism (docs/distributed.md).

    ``tensor_parallel_size x data_parallel_size`` ranks run the model; with
    ``enable_expert_parallel`` the MoE experts are placed over all of them. The
    executor starts the ranks: ``mp`` (spawned processes on this node), ``ray``
    (actors across a Ray cluster) or ``external_launcher`` (torchrun started every
    rank, each running this engine).
    """

    tensor_parallel_size: int = 1
    # Data-parallel engines (attention per rank, MoE in lockstep): under torchrun each process
    # is one; with mp / ray a front end starts them and balances requests (dp_frontend.py).
    data_parallel_size: int = 1
    # Place MoE experts over the ranks instead of slicing each expert (vLLM's flag).
    enable_expert_parallel: bool = False
    # Expert-parallel transport: "allgather_reducescatter" (vLLM's default) or "alltoall".
    all2all_backend: str = "allgather_reducescatter"
    # "mp", "ray" or "external_launcher"; None: mp when there is more than one rank.
    distributed_executor_backend: str | None = None
    # Seconds a collective waits for a peer before failing (a dead rank is an error).
    collective_timeout: float = 120.0
    # Device indices to use (``--device-ids 0,1`` or "0,1"), one per local rank;
    # CUDA_VISIBLE_DEVICES is never set.
    device_ids: list[int] | str | None = None
    # Force a platform by name (``--platform``); None: the present one with top priority.
    platform: str | None = None
    # Set by the data-parallel front end on the engine it builds for each DP rank (mp / ray):
    # which DP rank it is and the rendezvous every rank joins (``tcp://host:port``).
    data_parallel_rank: int | None = None
    data_parallel_init_method: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if (self.data_parallel_size > 1 and self.distributed_executor_backend == "ray"
                and self.tensor_parallel_size > 1):
            raise ValueError("--data-parallel-size > 1 with --tensor-parallel-size > 1 on the "
                             "ray executor is not implemented (each DP rank is one Ray actor); "
                             "use the mp executor on one node, or torchrun")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"--distributed-executor-backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"--all2all-backend must be one of {', '.join(ALL2ALL_BACKENDS)}, "
                             f"got {self.all2all_backend!r}")
        if self.collective_timeout <= 0:
            raise ValueError(f"collective_timeout must be positive, got "
                             f"{self.collective_timeout}")
        if self.device_ids is not None:
            from inference_engine.platforms.device_ids import parse_device_ids

            # Accepts "0,2" or [0, 2]; raises for non-integers, negatives, repeats.
            self.device_ids = parse_device_ids(self.device_ids)
        if self.device_ids and self.executor_backend == "external_launcher":
            if len(self.device_ids) < 1:
                raise ValueError("--device-ids is empty")
        elif self.device_ids and len(self.device_ids) != self.world_size:
            raise ValueError(
                f"--device-ids {','.join(map(str, self.device_ids))} names "
                f"{len(self.device_ids)} devices, but one rank drives one device and there are "
                f"{self.world_size} ranks (tensor_parallel_size {self.tensor_parallel_size} x "
                f"data_parallel_size {self.data_parallel_size}); pass one id per rank"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def executor_backend(self) -> str:
        """The executor in effect: the one asked for, else ``mp`` (``uni`` for one rank)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else "uni"


# How the ranks are started (--distributed-executor-backend, vLLM's names).
EXECUTOR_BACKENDS = ("mp", "ray", "external_launcher")
# Expert-parallel transports (--all2all-backend); see layers/moe/expert_parallel.py.
ALL2ALL_BACKENDS = ("allgather_reducescatter", "alltoall")


@dataclass
class QuantConfig:
    """Quantization method selection."""

    # Registered method name (``--quantization``); None: what the checkpoint says.
    method: str | None = None
    # Dequantize packed weights once at load (speed for memory); off by default.
    dequantize_at_load: bool = False
    # Method-specific settings (``--quant-option KEY=VALUE``), handed to the method, which
    # names the keys it takes in ``QuantMethod.option_names`` (others are refused at load).
    options: dict[str, str] = field(default_factory=dict)


@dataclass
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config JSON``, vLLM's keys); method None: off.

    Build it from the user's dict with :meth:`from_dict` (unknown keys are refused by
    name); ``method`` is a registered proposer (``list-plugins --kind proposers``),
    checked when the engine builds it.
    """

    # Registered proposer name: ngram, draft_model, ...; None turns speculation off.
    method: str | None = None
    # Drafted tokens per step (k); the target verifies k + 1 positions.
    num_speculative_tokens: int = 0
    # n-gram: shortest and longest suffix matched in the context (both 5 when unset).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: the drafter's folder (same vocabulary as the target).
    model: str | None = None
    # draft_model: dtype of the drafter; None: the target's.
    draft_dtype: str | None = None
    # Model drafters: "greedy" (argmax drafts, a point mass) or "probabilistic" (drafts
    # drawn with the request's sampling parameters, their probabilities q verified).
    draft_sample_method: str = "greedy"

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative_config 'method' must be a proposer name, got "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config 'num_speculative_tokens' must be an integer "
                             f">= 1, got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config {name!r} must be an integer >= 1, got "
                                 f"{value!r}")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config 'prompt_lookup_min' ({self.prompt_lookup_min})"
                             f" exceeds 'prompt_lookup_max' ({self.prompt_lookup_max})")
        if self.draft_dtype is not None and self.draft_dtype not in DTYPES:
            raise ValueError(f"speculative_config 'draft_dtype' must be one of {DTYPES}, got "
                             f"{self.draft_dtype!r}")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"speculative_config 'draft_sample_method' must be 'greedy' or "
                             f"'probabilistic', got {self.draft_sample_method!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """From ``--speculative-config`` / ``LLM(speculative_config=...)``: a dict, a
        JSON string, an instance, or None (off).

        Raises:
            ValueError: not a JSON object, an unknown key or a bad value (named).
        """
        import json

        if value is None or isinstance(value, SpeculativeConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        if "method" not in value and value:
            raise ValueError("speculative_config needs a 'method' (ngram, draft_model, ...)")
        return cls(**value)


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (``--enable-lora``; vLLM's option names and defaults)."""

    enable_lora: bool = False
    # Adapters held on the device at once (slots); a step runs at most this many.
    max_loras: int = 1
    # The largest adapter rank accepted (slots are this wide).
    max_lora_rank: int = 16
    # Adapters kept in host memory; None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")


@dataclass
class EngineConfig:
    """The root config handed to every engine component."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat vLLM-style keywords (``block_size=4``, ``quantization=...``).

        Raises:
            TypeError: for a keyword no sub-config knows.
        """
        aliases = {"quantization": ("quant", "method"), "quant_options": ("quant", "options")}
        parts: dict[str, dict[str, Any]] = {
            "model": {"model": model},
            "cache": {},
            "scheduler": {},
            "parallel": {},
            "quant": {},
            "speculative": {},
            "lora": {},
        }
        owners = {
            f.name: section
            for section, sub in (
                ("model", ModelConfig),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
                ("parallel", ParallelConfig),
                ("quant", QuantConfig),
                ("lora", LoRAConfig),
            )
            for f in fields(sub)
        }
        for key, value in kwargs.items():
            if key in aliases:
                section, name = aliases[key]
            elif key in owners:
                section, name = owners[key], key
            elif key == "speculative_config":  # vLLM's keyword: the whole section
                parts["speculative"] = {"config": SpeculativeConfig.from_dict(value)}
                continue
            else:
                raise TypeError(f"unknown engine argument {key!r}")
            parts[section][name] = value
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            parallel=ParallelConfig(**parts["parallel"]),
            quant=QuantConfig(**parts["quant"]),
            speculative=(parts["speculative"]["config"] if "config" in parts["speculative"]
                         else SpeculativeConfig(**parts["speculative"])),
            lora=LoRAConfig(**parts["lora"]),
        )
