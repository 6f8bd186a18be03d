"""Llama (and Llama-3 rope scaling): the shared decoder with no extras."""

from __future__ import annotations

from inference_engine.layers.decoder import DecoderForCausalLM

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False
    qkv_bias = False
