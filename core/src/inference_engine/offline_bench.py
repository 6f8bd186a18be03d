"""``inference-engine bench``: a fixed offline throughput workload through the engine.

The workload is deterministic for a seed: ``--num-prompts`` random token-id
prompts of ``--input-len`` tokens each, ``--output-len`` generated tokens each
(``ignore_eos``), all submitted at once through :class:`~inference_engine.LLM`.
It measures the engine on a given model and device (``--device-ids``,
``--platform``); comparisons with other engines live in ``bench/``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Optional

import typer

from inference_engine.cli_options import (
    AsyncSchedulingOption,
    EnforceEagerOption,
    GpuMemoryUtilizationOption,
    KvCacheDtypeOption,
    NumSchedulerStepsOption,
    PlatformOption,
    QuantizationOption,
    QuantOptionOption,
    SpeculativeConfigOption,
)
from inference_engine.cli_values import parse_key_values

__all__ = ["BenchResult", "bench_command", "run_offline_bench"]


@dataclass
class BenchResult:
    platform: str
    device: str
    num_prompts: int
    input_len: int
    output_len: int
    prompt_tokens: int
    generated_tokens: int
    kv_cache_dtype: str
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    # Speculative decoding counters of the measured run (None without speculation).
    spec_decode: dict[str, Any] | None = None


def _prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    import torch

    rng = torch.Generator().manual_seed(seed)
    # Stay clear of the top of the vocabulary, where tokenizers keep special tokens.
    high = vocab_size - 256 if vocab_size > 512 else vocab_size
    return torch.randint(0, high, (num_prompts, input_len), generator=rng).tolist()


def run_offline_bench(model: str, num_prompts: int = 32, input_len: int = 128,
                      output_len: int = 128, seed: int = 0, warmup: bool = True,
                      **engine_kwargs: Any) -> BenchResult:
    """Load ``model``, run the workload once (after a short warm-up), return the figures."""
    from inference_engine.entrypoints.llm import LLM
    from inference_engine.sampling_params import SamplingParams

    llm = LLM(model, show_progress=False, **engine_kwargs)
    vocab = len(llm.get_tokenizer())
    prompts = _prompts(vocab, num_prompts, input_len, seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if warmup:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    spec_before = _spec_stats(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    spec = _spec_delta(spec_before, _spec_stats(llm))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    platform = llm.engine.platform
    return BenchResult(
        platform=platform.name, device=f"{platform.device()} ({platform.device_name()})",
        num_prompts=num_prompts, input_len=input_len, output_len=output_len,
        prompt_tokens=prompt_tokens, generated_tokens=generated,
        kv_cache_dtype=str(llm.engine.runner.pool.specs[0].dtype).removeprefix("torch."),
        elapsed_s=round(elapsed, 3),
        requests_per_s=round(num_prompts / elapsed, 3),
        output_tokens_per_s=round(generated / elapsed, 1),
        total_tokens_per_s=round((generated + prompt_tokens) / elapsed, 1),
        spec_decode=spec,
    )


def _spec_stats(llm: Any) -> dict[str, Any] | None:
    spec = llm.engine.spec
    if spec is None:
        return None
    m = spec.metrics
    return {"num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
            "num_accepted_tokens": m.num_accepted_tokens,
            "accepted_per_pos": list(m.accepted_per_pos)}


def _spec_delta(before: dict[str, Any] | None, after: dict[str, Any] | None
                ) -> dict[str, Any] | None:
    """The measured run's speculative counters (the warm-up's taken off), with vLLM's
    acceptance length (1 + accepted per verifying request-step) and per-position rates."""
    if before is None or after is None:
        return None
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"],
                                     strict=True)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "acceptance_rate_per_pos": [round(n / drafts, 3) if drafts else 0.0 for n in per_pos],
    }


def bench_command(
    model: Annotated[str, typer.Option(help="Model folder (Hugging Face layout) or .gguf file.")],
    num_prompts: Annotated[int, typer.Option(min=1, help="Requests, all submitted at once.")] = 32,
    input_len: Annotated[int, typer.Option(min=1, help="Prompt tokens per request.")] = 128,
    output_len: Annotated[int, typer.Option(min=1, help="Generated tokens per request.")] = 128,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    max_num_seqs: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=1, help="Most sequences per step; default 256 on GPUs, 128 on CPU.")] = None,
    kv_cache_memory: Annotated[Optional[int], typer.Option(  # noqa: UP045 - typer needs Optional
        help="KV pool bytes; default a share of free memory.")] = None,
    kv_cache_dtype: KvCacheDtypeOption = "auto",
    gpu_memory_utilization: GpuMemoryUtilizationOption = 0.9,
    enforce_eager: EnforceEagerOption = False,
    async_scheduling: AsyncSchedulingOption = None,
    num_scheduler_steps: NumSchedulerStepsOption = 8,
    quantization: QuantizationOption = None,
    quant_option: QuantOptionOption = None,
    device_ids: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Device index to use, e.g. 1 (CUDA_VISIBLE_DEVICES is not touched).")] = None,
    platform: PlatformOption = None,
    speculative_config: SpeculativeConfigOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Offline throughput of a fixed random-prompt workload on MODEL."""
    from inference_engine.registry import UnknownNameError

    kwargs: dict[str, Any] = {"dtype": dtype, "max_num_seqs": max_num_seqs,
                              "kv_cache_memory": kv_cache_memory, "kv_cache_dtype": kv_cache_dtype,
                              "gpu_memory_utilization": gpu_memory_utilization,
                              "enforce_eager": enforce_eager,
                              "async_scheduling": async_scheduling,
                              "num_scheduler_steps": num_scheduler_steps,
                              "device_ids": device_ids,
                              "platform": platform}
    if quantization is not None:
        kwargs["quantization"] = quantization
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    try:
        if quant_option:
            kwargs["quant_options"] = parse_key_values(quant_option, "--quant-option")
        result = run_offline_bench(model, num_prompts, input_len, output_len, seed, **kwargs)
    except (ValueError, UnknownNameError, OSError, TypeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps(asdict(result)))
        return
    typer.echo(f"{result.platform} {result.device}: {result.num_prompts} requests x "
               f"{result.input_len} prompt + {result.output_len} output tokens in "
               f"{result.elapsed_s:.2f} s")
    typer.echo(f"  {result.requests_per_s:.2f} req/s, {result.output_tokens_per_s:.1f} output "
               f"tok/s, {result.total_tokens_per_s:.1f} total tok/s")
    if result.spec_decode is not None:
        s = result.spec_decode
        rates = ", ".join(f"{r:.2f}" for r in s["acceptance_rate_per_pos"])
        typer.echo(f"  speculative: acceptance length {s['mean_acceptance_length']:.2f}, "
                   f"{s['num_accepted_tokens']}/{s['num_draft_tokens']} drafts accepted, "
                   f"per position [{rates}]")
