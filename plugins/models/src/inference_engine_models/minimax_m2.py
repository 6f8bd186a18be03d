"""MiniMax-M2: q/k RMSNorm over all heads at once, partial rotary, sigmoid-routed experts.

Attention is the shared decoder's without biases, except that q and k are each
normalised as one ``[heads * head_dim]`` vector (one weight over all q heads,
one over all k heads) before rotary. Every layer is MoE (Mixtral's
``block_sparse_moe`` naming, experts ``w1`` gate / ``w3`` up / ``w2`` down);
the choice adds the block's ``e_score_correction_bias`` to the sigmoid scores
and the chosen weights are renormalised. ``rotary_dim`` in released configs
becomes transformers' ``partial_rotary_factor``.
"""

from __future__ import annotations

import torch
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    NormRotateQK,
    RMSNorm,
    RotaryTable,
)
from inference_engine.layers.moe import RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["MiniMaxM2Attention", "MiniMaxM2ForCausalLM"]


class MiniMaxM2Attention(DecoderAttention):
    """q norm over all q heads at once, k norm likewise, then rotary."""

    def make_qk_norm(self, ctx: ModelContext) -> tuple[nn.Module, nn.Module]:
        eps = ctx.hf_config.rms_norm_eps
        return RMSNorm(self.q_size, eps, ctx.dtype), RMSNorm(self.kv_size, eps, ctx.dtype)

    def choose_norm_rotate_qk(self, fused_op: str) -> NormRotateQK:
        # The norms pick their own kernel; rotary is the table's.
        return _norm_all_heads_rotate_qk


def _norm_all_heads_rotate_qk(attn: MiniMaxM2Attention, qkv: torch.Tensor,
                              rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    q_normed = attn.q_norm(qkv[:, :attn.q_size])  # [T, heads * D]
    k_normed = attn.k_norm(qkv[:, attn.q_size:attn.q_size + attn.kv_size])  # [T, kv_heads * D]
    qk = torch.cat((q_normed, k_normed), dim=1).view(qkv.shape[0], -1, attn.head_dim)
    q, k = rope.rotate(qk).split([attn.num_heads, attn.num_kv_heads], dim=1)
    return q, k


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    """No attention biases."""

    qkv_bias = False
    o_bias = False
    mlp_name = "block_sparse_moe"

    def make_attention(self, layer_idx: int) -> nn.Module:
        return MiniMaxM2Attention(self.ctx, self.module_prefix(layer_idx, "self_attn"),
                                  layer_idx, self.options)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        router = RouterSpec(cfg.num_local_experts, cfg.num_experts_per_tok, "sigmoid",
                            renormalize=True)
        return SparseMoeBlock(self.ctx, cfg.hidden_size, cfg.intermediate_size, router,
                              self.module_prefix(layer_idx, self.mlp_name),
                              correction_bias="block", expert_names=("w1", "w3", "w2"))
