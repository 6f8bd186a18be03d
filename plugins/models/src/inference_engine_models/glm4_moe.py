"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): partial rotary, optional q/k norm, sigmoid routing.

The first ``first_k_dense_replace`` layers keep a dense MLP; the rest route
with DeepSeek-V3's rule (sigmoid scores, ``e_score_correction_bias`` for the
choice, groups ranked by their top-2 sum, renormalised, times
``routed_scaling_factor``) and add always-on shared experts.
"""

from __future__ import annotations

from typing import Any

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import DecoderForCausalLM
from inference_engine.layers.moe import RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["Glm4MoeForCausalLM", "deepseek_v3_router"]


def deepseek_v3_router(cfg: Any) -> RouterSpec:
    """The sigmoid, bias-corrected, group-limited router of DeepSeek-V3-style configs."""
    return RouterSpec(
        cfg.n_routed_experts, cfg.num_experts_per_tok, "sigmoid",
        renormalize=bool(getattr(cfg, "norm_topk_prob", True)),
        num_groups=getattr(cfg, "n_group", None) or 1,
        topk_groups=getattr(cfg, "topk_group", None) or 1, group_score="top2_sum",
        routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", None) or 1.0))


class Glm4MoeForCausalLM(DecoderForCausalLM):
    """q/k/v biases follow ``config.attention_bias``; o_proj has none; per-head q/k norm
    when ``config.use_qk_norm``."""

    o_bias = False

    def __init__(self, ctx: ModelContext) -> None:
        self.qk_norm = bool(getattr(ctx.hf_config, "use_qk_norm", False))
        super().__init__(ctx)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        if layer_idx < cfg.first_k_dense_replace:
            return super().make_mlp(layer_idx)
        return SparseMoeBlock(
            self.ctx, cfg.hidden_size, cfg.moe_intermediate_size, deepseek_v3_router(cfg),
            self.module_prefix(layer_idx, self.mlp_name), correction_bias="gate",
            shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
