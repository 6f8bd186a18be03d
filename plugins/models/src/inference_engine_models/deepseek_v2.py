"""DeepSeek-V2 / V2-Lite: multi-head latent attention and softmax-routed MoE with shared experts.

Attention is :class:`~inference_engine.layers.mla.MLAAttention` (compressed
latent KV in the paged cache, absorbed-weights decode). The first
``first_k_dense_replace`` layers keep a dense MLP; the rest route by softmax,
top-k (``group_limited_greedy``: within the best ``topk_group`` groups, each
ranked by its best expert), times ``routed_scaling_factor``, plus shared experts.
"""

from __future__ import annotations

from inference_engine.layers import DecoderForCausalLM
from inference_engine.layers.mla import MLAAttention
from inference_engine.layers.moe import RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["DeepseekV2ForCausalLM"]


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """The shared decoder with MLA attention layers; dense MLPs in the first
    ``first_k_dense_replace`` layers."""

    def make_attention(self, layer_idx: int) -> nn.Module:
        return MLAAttention(self.ctx, self.module_prefix(layer_idx, "self_attn"))

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        if layer_idx < cfg.first_k_dense_replace:
            return super().make_mlp(layer_idx)
        grouped = cfg.topk_method == "group_limited_greedy"
        router = RouterSpec(
            cfg.n_routed_experts, cfg.num_experts_per_tok, "softmax",
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
            num_groups=cfg.n_group if grouped else 1,
            topk_groups=cfg.topk_group if grouped else 1, group_score="max",
            routed_scaling_factor=float(cfg.routed_scaling_factor))
        return SparseMoeBlock(self.ctx, cfg.hidden_size, cfg.moe_intermediate_size, router,
                              self.module_prefix(layer_idx, self.mlp_name),
                              shared_intermediate_size=cfg.moe_intermediate_size
                              * cfg.n_shared_experts)
