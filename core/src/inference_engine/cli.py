"""The ``inference-engine`` command line (typer); thin, calls into the rest."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from inference_engine import __version__
from inference_engine.cli_config_file import ConfigFileOption
from inference_engine.cli_options import (
    AsyncSchedulingOption,
    DequantizeAtLoadOption,
    EnableLoRAOption,
    EnforceEagerOption,
    GpuMemoryUtilizationOption,
    HfOverridesOption,
    IndexerDtypeOption,
    KvCacheDtypeOption,
    LoRAModulesOption,
    MaxCpuLoRAsOption,
    MaxLoRARankOption,
    MaxLoRAsOption,
    NumSchedulerStepsOption,
    PlatformOption,
    QuantizationOption,
    QuantOptionOption,
    SpeculativeConfigOption,
)
from inference_engine.cli_parallel import (
    All2AllBackendOption,
    DataParallelSizeOption,
    DistributedExecutorBackendOption,
    EnableExpertParallelOption,
    TensorParallelSizeOption,
    parallel_kwargs,
)
from inference_engine.cli_values import model_config_overrides, parse_key_values

app = typer.Typer(
    name="inference-engine",
    help="Plugin-based LLM inference and serving engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"inference-engine {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version_callback, is_eager=True,
                     help="Print the version and exit."),
    ] = None,
) -> None:
    """Plugin-based LLM inference and serving engine."""


@app.command("list-plugins")
def list_plugins(
    kind: Annotated[
        Optional[str],
        typer.Option(help="Only show plugins providing this kind (models, quantization, "
                          "platforms, attention_backends, weight_formats, tool_parsers, "
                          "reasoning_parsers, proposers)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 1 if any plugin failed to load.")] = False,
) -> None:
    """List installed plugins, their status and what each provides."""
    from inference_engine.plugins import get_plugins
    from inference_engine.registry import KINDS

    try:
        plugin_set = get_plugins()
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if kind is not None and kind not in KINDS.values():
        typer.echo(f"error: unknown kind {kind!r}; kinds: {', '.join(KINDS.values())}", err=True)
        raise typer.Exit(2)
    infos = plugin_set.infos
    if kind is not None:
        infos = [i for i in infos if i.provides.get(kind)]
    if as_json:
        typer.echo(json.dumps([i.as_json() for i in infos], indent=2))
    else:
        rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "PROVIDES")]
        for info in infos:
            provided = "; ".join(
                f"{k}: {', '.join(v)}" for k, v in info.provides.items()
                if v and (kind is None or k == kind)
            )
            status = info.status if info.error is None else f"error: {info.error}"
            rows.append((info.name, info.distribution or "-", info.version or "-", status,
                         provided or "-"))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        for row in rows:
            typer.echo("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row[:4]))
                       + "  " + row[4])
    if strict and plugin_set.errors():
        raise typer.Exit(1)


@app.command("generate")
def generate(
    prompt: Annotated[list[str], typer.Option(help="Prompt text; repeat for a batch.")],
    model: Annotated[Optional[str], typer.Option(
        help="Model folder (Hugging Face layout) or .gguf file; default: the demo model "
             "of this checkout (models/demo-qwen3-tiny).")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 means greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables top-k.")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Per-request sampling seed.")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    attention_backend: Annotated[str, typer.Option(
        help="Registered attention backend, or auto: the platform's best that supports each "
             "layer (triton on GPUs, cpu_paged on CPU).")] = "auto",
    kv_cache_dtype: KvCacheDtypeOption = "auto",
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block.")] = 16,
    kv_cache_memory: Annotated[Optional[int], typer.Option(help="KV pool bytes.")] = None,
    gpu_memory_utilization: GpuMemoryUtilizationOption = 0.9,
    enforce_eager: EnforceEagerOption = False,
    async_scheduling: AsyncSchedulingOption = None,
    num_scheduler_steps: NumSchedulerStepsOption = 8,
    ignore_eos: Annotated[bool, typer.Option(help="Do not stop at EOS.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt per line.")] = False,
    quantization: QuantizationOption = None,
    dequantize_at_load: DequantizeAtLoadOption = False,
    quant_option: QuantOptionOption = None,
    tensor_parallel_size: TensorParallelSizeOption = 1,
    data_parallel_size: DataParallelSizeOption = 1,
    enable_expert_parallel: EnableExpertParallelOption = False,
    distributed_executor_backend: DistributedExecutorBackendOption = None,
    all2all_backend: All2AllBackendOption = "allgather_reducescatter",
    device_ids: Annotated[Optional[str], typer.Option(
        help="Device index to use, e.g. 1, or one per rank, e.g. 0,1 with -tp 2 "
             "(CUDA_VISIBLE_DEVICES is not touched).")] = None,
    platform: PlatformOption = None,
    hf_overrides: HfOverridesOption = None,
    indexer_dtype: IndexerDtypeOption = None,
    speculative_config: SpeculativeConfigOption = None,
) -> None:
    """Generate completions for one or more prompts, batched together."""
    model = _model_or_demo(model, "--model PATH")
    from inference_engine.entrypoints.llm import LLM
    from inference_engine.registry import UnknownNameError
    from inference_engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        llm = LLM(model, dtype=dtype, attention_backend=attention_backend, block_size=block_size,
                  kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=gpu_memory_utilization,
                  enforce_eager=enforce_eager, async_scheduling=async_scheduling,
                  num_scheduler_steps=num_scheduler_steps,
                  kv_cache_memory=kv_cache_memory, show_progress=not as_json,
                  quantization=quantization, dequantize_at_load=dequantize_at_load,
                  quant_options=parse_key_values(quant_option, "--quant-option"),
                  device_ids=device_ids, platform=platform,
                  **parallel_kwargs(tensor_parallel_size, data_parallel_size,
                                  enable_expert_parallel, distributed_executor_backend,
                                  all2all_backend),
                  hf_overrides=model_config_overrides(hf_overrides, indexer_dtype),
                  speculative_config=speculative_config)
        outputs = llm.generate(list(prompt), params, use_tqdm=not as_json)
    except (ValueError, UnknownNameError, OSError, TypeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    for text, output in zip(prompt, outputs, strict=True):
        completion = output.outputs[0]
        if as_json:
            typer.echo(json.dumps({
                "prompt": text,
                "prompt_token_ids": output.prompt_token_ids,
                "token_ids": completion.token_ids,
                "text": completion.text,
                "finish_reason": completion.finish_reason,
            }, ensure_ascii=False))
        else:
            typer.echo(f"{text}{completion.text}")
            typer.echo(f"[{completion.finish_reason}, {len(completion.token_ids)} tokens]", err=True)


def _model_or_demo(model: Optional[str], hint: str) -> str:
    """``model``, or the demo model committed in this source checkout when none is given."""
    if model is not None:
        return model
    from pathlib import Path

    # This file is core/src/inference_engine/cli.py; the model sits under the repo root.
    demo = Path(__file__).resolve().parents[3] / "models" / "demo-qwen3-tiny"
    if (demo / "config.json").is_file():
        return str(demo)
    typer.echo(f"error: no model given and the demo model is not at {demo} (it ships only "
               f"with a source checkout); pass {hint}", err=True)
    raise typer.Exit(2)


def _split(values: Optional[list[str]]) -> list[str]:
    """Repeated and/or comma-separated option values as one list."""
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


def _parse_bytes(value: Optional[str]) -> Optional[int]:
    """``1073741824``, ``512MiB``, ``4GiB`` or ``2GB`` -> bytes."""
    if value is None:
        return None
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    text = value.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"expected bytes such as 1073741824, 512MiB or 4GiB, got "
                                 f"{value!r}", param_hint="--kv-cache-memory") from None


@app.command("serve")
def serve(
    model: Annotated[Optional[str], typer.Argument(
        help="Model folder (Hugging Face layout) or .gguf file; default: the demo model "
             "of this checkout (models/demo-qwen3-tiny).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind.")] = 8000,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        help="Name(s) clients use in 'model' (repeat or comma-separate); default: MODEL.")] = None,
    api_key: Annotated[Optional[list[str]], typer.Option(
        help="Accepted bearer key (repeat for several); also INFERENCE_ENGINE_API_KEY "
             "(comma-separated). Any key turns auth on.")] = None,
    enable_auth: Annotated[bool, typer.Option(
        help="Require a key on every endpoint except /health; fails without a key.")] = False,
    enable_cors: Annotated[bool, typer.Option(help="Send CORS headers for allowed origins.")] = False,
    cors_allow_origins: Annotated[Optional[list[str]], typer.Option(
        help="Allowed origins (repeat or comma-separate); default *.")] = None,
    cors_allow_methods: Annotated[Optional[list[str]], typer.Option(
        help="Allowed methods; default *.")] = None,
    cors_allow_headers: Annotated[Optional[list[str]], typer.Option(
        help="Allowed request headers; default *.")] = None,
    cors_allow_credentials: Annotated[bool, typer.Option(
        help="Allow credentialed CORS requests.")] = False,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        help="Registered tool parser (see list-plugins --kind tool_parsers).")] = None,
    reasoning_parser: Annotated[Optional[str], typer.Option(
        help="Registered reasoning parser.")] = None,
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        help="Parse tool calls for tool_choice=auto; picks parsers from the architecture "
             "when none are named.")] = False,
    tool_call_streaming: Annotated[str, typer.Option(
        help="incremental (argument fragments) or whole (a call once complete).")] = "incremental",
    chat_template: Annotated[Optional[str], typer.Option(
        help="Chat template replacing the tokenizer's: a file path, or the Jinja text "
             "itself.")] = None,
    trust_request_chat_template: Annotated[bool, typer.Option(
        help="Render a chat request's own chat_template field (Jinja code run on the "
             "server); without it such a request is refused.")] = False,
    tokenizer: Annotated[Optional[str], typer.Option(
        help="Tokenizer folder; default: the model's own.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(
        help="Run the configuration code a model folder ships (config.json auto_map).")] = False,
    hf_overrides: HfOverridesOption = None,
    indexer_dtype: IndexerDtypeOption = None,
    speculative_config: SpeculativeConfigOption = None,
    generation_config: Annotated[str, typer.Option(
        help="Request sampling defaults: auto (the model's generation_config.json), vllm "
             "(none) or a folder holding a generation_config.json.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    max_model_len: Annotated[Optional[int], typer.Option(
        min=1, help="Context limit; default the model's.")] = None,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block.")] = 16,
    max_num_seqs: Annotated[Optional[int], typer.Option(
        min=1, help="Most sequences per step; default 256 on GPUs, 128 on CPU.")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(
        min=1, help="Token budget of one step.")] = 2048,
    kv_cache_memory: Annotated[Optional[str], typer.Option(
        help="KV pool size in bytes (512MiB, 4GiB); overrides --gpu-memory-utilization; "
             "default on CPU a share of free memory.")] = None,
    gpu_memory_utilization: GpuMemoryUtilizationOption = 0.9,
    enforce_eager: EnforceEagerOption = False,
    async_scheduling: AsyncSchedulingOption = None,
    num_scheduler_steps: NumSchedulerStepsOption = 8,
    enable_prefix_caching: Annotated[bool, typer.Option(
        help="Reuse cached prompt blocks across requests.")] = True,
    attention_backend: Annotated[str, typer.Option(
        help="Registered attention backend, or auto: the platform's best that supports each "
             "layer (triton on GPUs, cpu_paged on CPU).")] = "auto",
    kv_cache_dtype: KvCacheDtypeOption = "auto",
    quantization: QuantizationOption = None,
    dequantize_at_load: DequantizeAtLoadOption = False,
    quant_option: QuantOptionOption = None,
    tensor_parallel_size: TensorParallelSizeOption = 1,
    data_parallel_size: DataParallelSizeOption = 1,
    enable_expert_parallel: EnableExpertParallelOption = False,
    distributed_executor_backend: DistributedExecutorBackendOption = None,
    all2all_backend: All2AllBackendOption = "allgather_reducescatter",
    device_ids: Annotated[Optional[str], typer.Option(
        help="Comma-separated device indices to use, one per rank (CUDA_VISIBLE_DEVICES is "
             "not touched).")] = None,
    platform: PlatformOption = None,
    seed: Annotated[int, typer.Option(help="Base seed for unseeded requests.")] = 0,
    enable_lora: EnableLoRAOption = False,
    lora_modules: LoRAModulesOption = None,
    max_loras: MaxLoRAsOption = 1,
    max_lora_rank: MaxLoRARankOption = 16,
    max_cpu_loras: MaxCpuLoRAsOption = None,
    shutdown_timeout: Annotated[float, typer.Option(
        min=0.0, help="Seconds in-flight requests get after SIGINT/SIGTERM before they are "
             "aborted (0: abort at once).")] = 30.0,
    vllm_metric_names: Annotated[bool, typer.Option(
        help="Also expose /metrics under vLLM's names (vllm: prefix) for its dashboards.")] = False,
    max_audio_file_size_mb: Annotated[float, typer.Option(
        help="Largest audio upload /v1/audio/transcriptions and /translations take "
             "(MiB).")] = 25.0,
    max_audio_seconds: Annotated[float, typer.Option(
        help="Longest audio a transcription takes (seconds); longer uploads are a "
             "400.")] = 1800.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    config: ConfigFileOption = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (uvicorn)."""
    import logging

    from inference_engine.config import EngineConfig, ServerConfig, api_key_from_env
    from inference_engine.entrypoints.chat_template import load_chat_template
    from inference_engine.entrypoints.openai.server import run_server
    from inference_engine.registry import UnknownNameError

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model = _model_or_demo(model, "MODEL")
    keys = _split(api_key) + _split([api_key_from_env()] if api_key_from_env() else [])
    try:
        server_config = ServerConfig(
            host=host, port=port, served_model_names=_split(served_model_name), api_keys=keys,
            enable_auth=enable_auth, enable_cors=enable_cors,
            cors_allow_origins=_split(cors_allow_origins) or ["*"],
            cors_allow_methods=_split(cors_allow_methods) or ["*"],
            cors_allow_headers=_split(cors_allow_headers) or ["*"],
            cors_allow_credentials=cors_allow_credentials, tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser, enable_auto_tool_choice=enable_auto_tool_choice,
            tool_call_streaming=tool_call_streaming, shutdown_timeout=shutdown_timeout,
            chat_template=None if chat_template is None else load_chat_template(chat_template),
            trust_request_chat_template=trust_request_chat_template,
            log_level=log_level.lower(), vllm_metric_names=vllm_metric_names,
            max_audio_file_size_mb=max_audio_file_size_mb, max_audio_seconds=max_audio_seconds,
            lora_modules=parse_key_values(lora_modules, "--lora-modules"),
        )
        engine_config = EngineConfig.from_kwargs(
            model, tokenizer=tokenizer, generation_config=generation_config,
            trust_remote_code=trust_remote_code, dtype=dtype,
            max_model_len=max_model_len, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=_parse_bytes(kv_cache_memory),
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            async_scheduling=async_scheduling, num_scheduler_steps=num_scheduler_steps,
            enable_prefix_caching=enable_prefix_caching, attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype, device_ids=device_ids, platform=platform, seed=seed,
            **parallel_kwargs(tensor_parallel_size, data_parallel_size,
                              enable_expert_parallel, distributed_executor_backend,
                              all2all_backend),
            quantization=quantization, dequantize_at_load=dequantize_at_load,
            quant_options=parse_key_values(quant_option, "--quant-option"),
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            hf_overrides=model_config_overrides(hf_overrides, indexer_dtype),
            speculative_config=speculative_config)
        run_server(engine_config, server_config)
    except (ValueError, UnknownNameError, OSError, TypeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command("parse")
def parse(
    tool_parser: Annotated[Optional[str], typer.Option(help="Registered tool parser name.")] = None,
    reasoning_parser: Annotated[Optional[str], typer.Option(help="Registered reasoning parser name.")] = None,
    tools: Annotated[Optional[str], typer.Option(help="JSON file with the OpenAI tools list.")] = None,
    chunk_size: Annotated[Optional[int], typer.Option(min=1, help="Stream in deltas of N characters.")] = None,
    stream_random: Annotated[Optional[int], typer.Option(help="Stream in random deltas from this seed.")] = None,
    tool_call_streaming: Annotated[str, typer.Option(help="incremental or whole.")] = "incremental",
    thinking: Annotated[Optional[bool], typer.Option("--thinking/--no-thinking",
                                                    help="Force thinking on or off.")] = None,
) -> None:
    """Parse a saved model output from stdin; print reasoning, content and tool calls as JSON."""
    import sys

    from inference_engine.parsing import run_parse
    from inference_engine.registry import UnknownNameError

    if tool_parser is None and reasoning_parser is None:
        typer.echo("error: give --tool-parser and/or --reasoning-parser", err=True)
        raise typer.Exit(2)
    try:
        tool_list = None
        if tools is not None:
            with open(tools) as f:
                tool_list = json.load(f)
        result = run_parse(sys.stdin.read(), tool_parser=tool_parser,
                           reasoning_parser=reasoning_parser, tools=tool_list,
                           chunk_size=chunk_size, stream_seed=stream_random,
                           mode=tool_call_streaming, enable_thinking=thinking)
    except (UnknownNameError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(result, ensure_ascii=False))


# Commands that live in their own modules.
from inference_engine.env_report import env_command  # noqa: E402
from inference_engine.offline_bench import bench_command  # noqa: E402

app.command("env")(env_command)
app.command("bench")(bench_command)


@app.command("quantize")
def quantize(
    model: Annotated[str, typer.Argument(help="Unquantized Hugging Face checkpoint folder.")],
    method: Annotated[str, typer.Option(help="fp8 or fp8-block (more with the MX methods).")],
    out: Annotated[str, typer.Option(help="Output folder for the quantized checkpoint.")],
    layout: Annotated[Optional[str], typer.Option(
        help="FP8 weight layout: KN (the engine's, default) or NK (HF/vLLM).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty --out.")] = False,
) -> None:
    """Write MODEL quantized with --method into --out (needs inference-engine-quant)."""
    try:
        from inference_engine_quant.quantize_cli import run_quantize_command
    except ImportError as exc:
        typer.echo("error: quantize needs inference-engine-quant: pip install "
                   "inference-engine-quant", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(run_quantize_command(model, method, out, layout, overwrite))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
