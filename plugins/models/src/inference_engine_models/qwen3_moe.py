"""Qwen3-MoE: the Qwen3 decoder (per-head q/k norm) with sparse MoE MLPs."""

from __future__ import annotations

from inference_engine.layers import DecoderForCausalLM
from inference_engine.layers.moe import RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["Qwen3MoeForCausalLM"]


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Softmax routing, top-k, optional renormalisation (``norm_topk_prob``).

    Layers in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP.
    """

    qk_norm = True

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        if layer_idx in (getattr(cfg, "mlp_only_layers", None) or []) or (layer_idx + 1) % step:
            return super().make_mlp(layer_idx)
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, "softmax",
                            renormalize=bool(cfg.norm_topk_prob))
        return SparseMoeBlock(self.ctx, cfg.hidden_size, cfg.moe_intermediate_size, router,
                              self.module_prefix(layer_idx, self.mlp_name))
