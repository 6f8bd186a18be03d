"""Reference backend: each sequence's context is gathered and attended on its own.

Slow but plain; the paged backend is checked against it.
"""

from __future__ import annotations

import torch

from inference_engine.builtin.attention.attention_reference import dequantize
from inference_engine.builtin.attention.common import (
    attend_sequence,
    causal_mask,
    gather_context,
    write_kv,
)
from inference_engine.builtin.attention.prefix_block import PrefixBlockAttention
from inference_engine.interfaces.attention import AttentionBackend, AttentionMetadata

__all__ = ["TorchSDPABackend"]


class TorchSDPABackend(PrefixBlockAttention, AttentionBackend):
    """Per-sequence ``scaled_dot_product_attention`` over the gathered context."""

    name = "torch_sdpa"
    supports_sinks = True

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype) -> bool:
        # Any dtype torch casts to and from; a float8 cache with its per-tensor scales.
        return dtype.is_floating_point

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, key, value, metadata, self.k_scale, self.v_scale)
        out = torch.empty(
            query.shape[0], self.num_heads, self.head_dim, dtype=query.dtype, device=query.device
        )
        starts = metadata.query_start_loc.tolist()
        for i, seq_len in enumerate(metadata.seq_lens_list):
            start, end = starts[i], starts[i + 1]
            table = metadata.block_tables[i]
            k = self._read(gather_context(k_cache, table, seq_len, metadata.block_size),
                           self.k_scale, query.dtype)
            v = self._read(gather_context(v_cache, table, seq_len, metadata.block_size),
                           self.v_scale, query.dtype)
            mask = causal_mask(end - start, seq_len, query.device, self.sliding_window)
            out[start:end] = attend_sequence(query[start:end], k, v, self.scale, mask, self.sinks)
        return out.view(query.shape[0], self.num_heads * self.head_dim)

    @staticmethod
    def _read(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Cached entries in ``dtype``: a float8 cache's values times its scale."""
        if cached.dtype == torch.float8_e4m3fn:
            return dequantize(cached, scale).to(dtype)
        return cached.to(dtype)
