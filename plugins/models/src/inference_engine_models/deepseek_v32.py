"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 with DeepSeek Sparse Attention.

Every layer's MLA attends only the ``index_topk`` positions its lightning
indexer scores highest (:class:`~inference_engine.layers.sparse_mla.SparseMLAAttention`;
the indexer's per-token key lives in the paged pool beside the MLA latent).
The indexer rotates its ``[rope | nope]`` key and queries as neox halves, while
the main attention rotates ``[nope | rope]`` as interleaved pairs. Routing,
shared experts and the dense first layers (``mlp_layer_types``) are V3's.
"""

from __future__ import annotations

from inference_engine.layers.sparse_mla import SparseMLAAttention
from torch import nn

from inference_engine_models.deepseek_v3 import DeepseekV3ForCausalLM

__all__ = ["DeepseekV32ForCausalLM"]


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """V3 with an indexer on every layer."""

    # Whether the indexer's rope pairs are interleaved (GLM-5) rather than neox halves.
    indexer_rope_interleaved: bool = False

    def has_indexer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` runs its own indexer (every layer on V3.2)."""
        return True

    def make_attention(self, layer_idx: int) -> nn.Module:
        return SparseMLAAttention(self.ctx, self.module_prefix(layer_idx, "self_attn"),
                                  self.has_indexer(layer_idx), self.indexer_rope_interleaved)
