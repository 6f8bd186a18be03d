"""Registrations of the core's built-ins; targets stay strings until used."""

from __future__ import annotations

import os

from inference_engine.hookspecs import hookimpl
from inference_engine.registry import Spec


@hookimpl
def ie_register_platforms() -> list[Spec]:
    return [
        Spec("cpu", "inference_engine.builtin.platforms.cpu:CpuPlatform", "CPU (always present)"),
        Spec("cuda", "inference_engine.builtin.platforms.cuda:CudaPlatform", "NVIDIA CUDA GPUs"),
    ]


@hookimpl
def ie_register_attention_backends() -> list[Spec]:
    return [
        Spec(
            "triton",
            "inference_engine.builtin.attention.triton:TritonAttentionBackend",
            "Triton kernels over the paged pool: one launch per layer for a mixed batch "
            "(GPU platforms)",
        ),
        Spec(
            "cpu_paged",
            "inference_engine.builtin.attention.cpu_paged:CpuPagedAttentionBackend",
            "C++ CPU kernels reading the paged pool in place (CPU platform)",
        ),
        Spec(
            "paged",
            "inference_engine.builtin.attention.cpu_paged:CpuPagedAttentionBackend",
            "Former name of cpu_paged",
        ),
        Spec(
            "torch_sdpa",
            "inference_engine.builtin.attention.torch_sdpa:TorchSDPABackend",
            "Reference: per-sequence SDPA over the gathered context",
        ),
    ]


@hookimpl
def ie_register_quantization_methods() -> list[Spec]:
    return [
        Spec(
            "unquantized",
            "inference_engine.builtin.quant.unquantized:UnquantizedMethod",
            "Dense weights in the model dtype",
        )
    ]


@hookimpl
def ie_register_weight_formats() -> list[Spec]:
    return [
        Spec(
            "safetensors",
            "inference_engine.builtin.weights.safetensors_format:SafetensorsFormat",
            "Hugging Face folder: config.json + (sharded) safetensors",
        )
    ]


@hookimpl
def ie_register_proposers() -> list[Spec]:
    return [
        Spec("ngram", "inference_engine.speculative.ngram:NgramProposer",
             "Prompt lookup: the tokens that followed the context's last n-gram (no model)"),
        Spec("draft_model", "inference_engine.speculative.draft_model:DraftModelProposer",
             "A small model of the same vocabulary, its own KV in a paged pool"),
        Spec("eagle3", "inference_engine.speculative.eagle3:Eagle3Proposer",
             "EAGLE-3: one layer over target hidden states of 3 layers (vLLM's Llama layout)"),
        Spec("dflash", "inference_engine.speculative.dflash:DFlashProposer",
             "DFlash: a block-diffusion drafter, a whole block of drafts in one forward"),
    ]


@hookimpl
def ie_detect_weight_format(path: str) -> str | None:
    """Name the format from the path alone, so a missing plugin can be named too."""
    if path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path):
        names = os.listdir(path)
        if any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
            return "safetensors"
        if any(n.endswith(".gguf") for n in names):
            return "gguf"
    elif path.endswith(".safetensors"):
        return "safetensors"
    return None
