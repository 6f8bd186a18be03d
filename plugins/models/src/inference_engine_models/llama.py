"""Llama 2/3 (and Llama-3 rope scaling): the shared decoder, biases from the config."""

from __future__ import annotations

from inference_engine.layers import DecoderForCausalLM

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    """q/k/v/o biases follow ``config.attention_bias``, MLP biases ``config.mlp_bias``."""

    qk_norm = False
