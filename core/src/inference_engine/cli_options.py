"""Command-line options several commands share (``generate``, ``serve``, ``bench``), declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

__all__ = ["AsyncSchedulingOption", "DequantizeAtLoadOption", "EnableLoRAOption",
           "EnforceEagerOption", "GpuMemoryUtilizationOption", "HfOverridesOption",
           "IndexerDtypeOption", "KvCacheDtypeOption", "LoRAModulesOption", "MaxCpuLoRAsOption",
           "MaxLoRARankOption", "MaxLoRAsOption", "NumSchedulerStepsOption", "PlatformOption",
           "QuantOptionOption", "QuantizationOption", "SpeculativeConfigOption"]

GpuMemoryUtilizationOption = Annotated[float, typer.Option(
    min=0.0, max=1.0, help="Fraction of GPU memory the engine may use; the KV cache gets "
                           "what weights and a profiling forward leave.")]
EnforceEagerOption = Annotated[bool, typer.Option(
    help="Never capture CUDA graphs (every step eager).")]
AsyncSchedulingOption = Annotated[Optional[bool], typer.Option(  # noqa: UP045 - typer needs Optional
    help="Launch each step before the previous one's tokens are read back; default: on for "
         "GPUs, off on CPU.")]
NumSchedulerStepsOption = Annotated[int, typer.Option(
    min=1, help="Greedy decode steps one engine step may run in one call for a lone plain-greedy "
                "request (multi-step; models with the CPU C++ decode step); a request "
                "arriving meanwhile waits at most this many tokens. 1: one step at a time.")]
HfOverridesOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    help="JSON object of config.json values to replace before the model is built, e.g. "
         "'{\"indexer_dtype\": \"fp8\"}'.")]
IndexerDtypeOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    help="Sparse-attention indexer keys (DeepSeek-V3.2, GLM-5, MiniMax-M3): auto (fp8 with an "
         "fp8 KV cache, else the model's dtype), fp8 or model; default: the checkpoint's.")]
EnableLoRAOption = Annotated[bool, typer.Option(
    help="Serve LoRA adapters (PEFT format) beside the base model.")]
LoRAModulesOption = Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
    help="NAME=PATH of a LoRA adapter served as model NAME; repeat for more "
         "(needs --enable-lora).")]
MaxLoRAsOption = Annotated[int, typer.Option(
    min=1, help="LoRA adapters on the device at once (one step runs at most this many).")]
SpeculativeConfigOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    help="Speculative decoding as a JSON object (vLLM's keys), e.g. '{\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' or '{\"method\": "
         "\"draft_model\", \"model\": \"PATH\", \"num_speculative_tokens\": 3}'; methods: "
         "list-plugins --kind proposers.")]
MaxLoRARankOption = Annotated[int, typer.Option(min=1, help="The largest LoRA rank accepted.")]
MaxCpuLoRAsOption = Annotated[Optional[int], typer.Option(  # noqa: UP045
    min=1, help="LoRA adapters kept in host memory; default: --max-loras.")]
KvCacheDtypeOption = Annotated[str, typer.Option(
    help="KV cache type: auto (a bfloat16 model caches bfloat16), float32, bfloat16 or fp8 "
         "(e4m3, on backends that support it).")]
QuantizationOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    help="Quantization method (fp8, ptpc_fp8, ...); default: the checkpoint's own.")]
DequantizeAtLoadOption = Annotated[bool, typer.Option(
    help="Dequantize packed (FP4/FP8) weights once at load: faster on CPU, bf16 memory.")]
QuantOptionOption = Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
    help="KEY=VALUE setting of the quantization method, repeatable "
         "(gguf: activations=q8|float, accumulate=float64).")]
PlatformOption = Annotated[Optional[str], typer.Option(  # noqa: UP045
    help="Force a platform by name.")]
