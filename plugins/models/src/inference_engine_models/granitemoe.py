"""GraniteMoE: a Llama-shaped decoder with MoE MLPs and Granite's four scalings.

The embedding, residual-branch, attention and logits multipliers come from
the config (see :class:`~inference_engine.layers.DecoderOptions`). Experts
are stored stacked (``input_linear [E, 2I, H]``, ``output_linear [E, H, I]``),
the layouts our experts use, so loading only renames them.
"""

from __future__ import annotations

from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import DecoderForCausalLM
from inference_engine.layers.moe import RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["GraniteMoeForCausalLM"]


class GraniteMoeForCausalLM(DecoderForCausalLM):
    """Top-k of the router logits, softmax over those k."""

    mlp_name = "block_sparse_moe"
    checkpoint_renames = (
        (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
        (".block_sparse_moe.router.layer.", ".block_sparse_moe.gate."),
        (".block_sparse_moe.router.weight", ".block_sparse_moe.gate.weight"),
    )

    def make_mlp(self, ctx: ModelContext, prefix: str, layer_idx: int) -> nn.Module | None:
        cfg = ctx.hf_config
        router = RouterSpec(cfg.num_local_experts, cfg.num_experts_per_tok, "topk_softmax")
        return SparseMoeBlock(ctx, cfg.hidden_size, cfg.intermediate_size, router, prefix)
