"""Registrations of inference-engine-gguf-plugin; targets stay strings until used."""

from __future__ import annotations

from inference_engine import hookimpl
from inference_engine.registry import Spec


@hookimpl
def ie_register_weight_formats() -> list[Spec]:
    return [
        Spec("gguf", "inference_engine_gguf.format:GGUFFormat",
             "GGUF single-file checkpoints (llama.cpp): config, tensors and tokenizer"),
    ]


@hookimpl
def ie_register_quantization_methods() -> list[Spec]:
    return [
        Spec("gguf", "inference_engine_gguf.quant_method:GGUFMethod",
             "GGML types (F32/F16/BF16, Q4_0..Q8_0, Q2_K..Q6_K, MXFP4) kept in their "
             "blocks, dequantized per matmul"),
    ]
