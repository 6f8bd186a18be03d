"""Qwen2: the shared decoder with biases on the q/k/v projections."""

from __future__ import annotations

from inference_engine.layers.decoder import DecoderForCausalLM

__all__ = ["Qwen2ForCausalLM"]


class Qwen2ForCausalLM(DecoderForCausalLM):
    qk_norm = False
    qkv_bias = True
