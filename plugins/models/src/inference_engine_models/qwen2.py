"""Qwen2 / Qwen2.5: the shared decoder with biases on q/k/v (none on o_proj)."""

from __future__ import annotations

from inference_engine.layers import DecoderForCausalLM

__all__ = ["Qwen2ForCausalLM"]


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Sliding-window layers, when enabled, come from ``config.layer_types``."""

    qk_norm = False
    qkv_bias = True
    o_bias = False
