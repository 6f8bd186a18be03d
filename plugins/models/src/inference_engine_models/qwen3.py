"""Qwen3: the shared decoder with per-head RMSNorm on q and k; ``head_dim`` from the config."""

from __future__ import annotations

from inference_engine.layers import DecoderForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(DecoderForCausalLM):
    """q/k/v/o biases follow ``config.attention_bias`` (off in released models)."""

    qk_norm = True
