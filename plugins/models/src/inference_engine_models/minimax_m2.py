"""MiniMax-M2: q/k RMSNorm over all heads at once, partial rotary, sigmoid-routed experts.

Every layer is MoE (Mixtral's ``block_sparse_moe`` naming, experts ``w1``
gate / ``w3`` up / ``w2`` down); the choice adds the block's
``e_score_correction_bias`` to the sigmoid scores and the chosen weights are
renormalised. ``rotary_dim`` in released configs becomes transformers'
``partial_rotary_factor``.
"""

from __future__ import annotations

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import DecoderForCausalLM
from inference_engine.layers.moe import RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["MiniMaxM2ForCausalLM"]


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    """No attention biases."""

    qk_norm = True
    qk_norm_scope = "all_heads"
    qkv_bias = False
    o_bias = False
    mlp_name = "block_sparse_moe"

    def make_mlp(self, ctx: ModelContext, prefix: str, layer_idx: int) -> nn.Module | None:
        cfg = ctx.hf_config
        router = RouterSpec(cfg.num_local_experts, cfg.num_experts_per_tok, "sigmoid",
                            renormalize=True)
        return SparseMoeBlock(ctx, cfg.hidden_size, cfg.intermediate_size, router, prefix,
                              correction_bias="block", expert_names=("w1", "w3", "w2"))
