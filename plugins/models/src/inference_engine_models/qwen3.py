"""Qwen3: the shared decoder with per-head RMSNorm on q and k, no qkv bias."""

from __future__ import annotations

from inference_engine.layers.decoder import DecoderForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
    qkv_bias = False
