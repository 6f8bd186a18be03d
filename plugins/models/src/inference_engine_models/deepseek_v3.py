"""DeepSeek-V3 / R1: DeepSeek-V2's multi-head latent attention with sigmoid "noaux_tc" routing.

Attention is :class:`~inference_engine.layers.mla.MLAAttention`, as in V2, with
the rope dims interleaved unless ``config.rope_interleave`` is false. The MoE
layers route by sigmoid scores; ``e_score_correction_bias`` (on the gate) only
picks the experts: groups ranked by the sum of their top-2 biased scores, the
best ``topk_group`` groups kept, top-k within them, the unbiased scores of the
chosen experts renormalised and times ``routed_scaling_factor``; shared experts
are always on. The first ``first_k_dense_replace`` layers keep a dense MLP.
"""

from __future__ import annotations

from typing import Any

import torch
from inference_engine.layers.mla import MLAAttention
from inference_engine.layers.moe import SparseMoeBlock
from torch import nn

from inference_engine_models.deepseek_v2 import DeepseekV2ForCausalLM
from inference_engine_models.glm4_moe import deepseek_v3_router

__all__ = ["DeepseekV3ForCausalLM", "is_dense_layer"]


def is_dense_layer(cfg: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` keeps a dense MLP: ``mlp_layer_types`` where the config
    lists it (V3.2, GLM-5), else the first ``first_k_dense_replace`` layers."""
    types = getattr(cfg, "mlp_layer_types", None)
    if types is not None:
        return types[layer_idx] == "dense"
    return layer_idx < (cfg.first_k_dense_replace or 0)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's decoder with V3's router; half-split rope when ``rope_interleave`` is false."""

    def make_attention(self, layer_idx: int) -> nn.Module:
        attn = super().make_attention(layer_idx)
        if isinstance(attn, MLAAttention) and not getattr(self.ctx.hf_config,
                                                          "rope_interleave", True):
            # Already neox halves: no de-interleaving.
            attn.rope_perm = torch.arange(attn.rope_dim)
        return attn

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        if is_dense_layer(cfg, layer_idx):
            return super(DeepseekV2ForCausalLM, self).make_mlp(layer_idx)
        return SparseMoeBlock(
            self.ctx, cfg.hidden_size, cfg.moe_intermediate_size, deepseek_v3_router(cfg),
            self.module_prefix(layer_idx, self.mlp_name), correction_bias="gate",
            shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
