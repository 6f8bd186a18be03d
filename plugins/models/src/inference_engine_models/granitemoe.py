"""GraniteMoE: a Llama-shaped decoder with MoE MLPs and Granite's four scalings.

From the config: ``embedding_multiplier`` scales the embeddings,
``residual_multiplier`` each residual branch, ``attention_multiplier`` is the
softmax scale and ``logits_scaling`` divides the logits (each 1.0 / the
default scale when unset). Experts are stored stacked (``input_linear
[E, 2I, H]``, ``output_linear [E, H, I]``), the layouts our experts use, so
loading only renames them.
"""

from __future__ import annotations

from typing import Any

import torch
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import DecoderAttention, DecoderForCausalLM
from inference_engine.layers.moe import RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["GraniteMoeAttention", "GraniteMoeForCausalLM"]


class GraniteMoeAttention(DecoderAttention):
    """The shared attention with ``config.attention_multiplier`` as the softmax scale."""

    def softmax_scale(self, cfg: Any) -> float:
        return getattr(cfg, "attention_multiplier", None) or super().softmax_scale(cfg)


class GraniteMoeForCausalLM(DecoderForCausalLM):
    """Top-k of the router logits, softmax over those k."""

    mlp_name = "block_sparse_moe"
    checkpoint_renames = (
        (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
        (".block_sparse_moe.router.layer.", ".block_sparse_moe.gate."),
        (".block_sparse_moe.router.weight", ".block_sparse_moe.gate.weight"),
    )

    def __init__(self, ctx: ModelContext) -> None:
        cfg = ctx.hf_config
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", None) or 1.0)
        self.residual_scale = float(getattr(cfg, "residual_multiplier", None) or 1.0)
        self.logits_scaling = float(getattr(cfg, "logits_scaling", None) or 1.0)
        super().__init__(ctx)

    def make_attention(self, layer_idx: int) -> nn.Module:
        return GraniteMoeAttention(self.ctx, self.module_prefix(layer_idx, "self_attn"),
                                   layer_idx, self.options)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        router = RouterSpec(cfg.num_local_experts, cfg.num_experts_per_tok, "topk_softmax")
        return SparseMoeBlock(self.ctx, cfg.hidden_size, cfg.intermediate_size, router,
                              self.module_prefix(layer_idx, self.mlp_name))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        return hidden * self.embedding_multiplier if self.embedding_multiplier != 1.0 else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits
