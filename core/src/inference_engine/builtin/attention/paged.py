"""Default backend: batched decode read through block tables, prefill per sequence.

Decodes (query length one) are attended in a single batched call over their
gathered blocks, so the per-step Python work does not grow with the number of
running sequences; prefill chunks without cached context attend their own
keys directly with a causal kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_engine.builtin.attention.common import (
    attend_sequence,
    causal_mask,
    gather_blocks,
    gather_context,
    write_kv,
)
from inference_engine.interfaces.attention import AttentionBackend, AttentionMetadata

__all__ = ["PagedAttentionBackend"]


class PagedAttentionBackend(AttentionBackend):
    """Paged attention with a batched decode path."""

    name = "paged"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, key, value, metadata)
        num_decodes = metadata.num_decodes
        gqa = self.num_kv_heads != self.num_heads
        if num_decodes == metadata.num_seqs:
            out = self._decode(query, k_cache, v_cache, metadata, gqa)
            return out.view(query.shape[0], self.num_heads * self.head_dim)
        out = torch.empty(
            query.shape[0], self.num_heads, self.head_dim, dtype=query.dtype, device=query.device
        )
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], k_cache, v_cache, metadata, gqa)
        starts = metadata.query_start_loc.tolist()
        for i in range(num_decodes, metadata.num_seqs):
            start, end = starts[i], starts[i + 1]
            seq_len = metadata.seq_lens_list[i]
            q = query[start:end]
            if seq_len == end - start and self.sliding_window is None:
                # Nothing cached before this chunk: attend the new keys directly.
                out[start:end] = attend_sequence(q, key[start:end], value[start:end], self.scale)
            else:
                table = metadata.block_tables[i]
                bs = metadata.block_size
                k = gather_context(k_cache, table, seq_len, bs).to(query.dtype)
                v = gather_context(v_cache, table, seq_len, bs).to(query.dtype)
                mask = causal_mask(end - start, seq_len, query.device, self.sliding_window)
                out[start:end] = attend_sequence(q, k, v, self.scale, mask)
        return out.view(query.shape[0], self.num_heads * self.head_dim)

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        gqa: bool,
    ) -> torch.Tensor:
        """``[num_decodes, heads, head_dim]`` for one query per sequence."""
        n = query.shape[0]
        bs = metadata.block_size
        max_len = metadata.max_decode_seq_len or max(metadata.seq_lens_list[:n])
        num_blocks = -(-max_len // bs)
        table = metadata.block_tables[:n, :num_blocks]
        padded = num_blocks * bs
        flat = table.reshape(-1)
        k = gather_blocks(k_cache, flat, "k").view(n, padded, self.num_kv_heads, self.head_dim)
        v = gather_blocks(v_cache, flat, "v").view(n, padded, self.num_kv_heads, self.head_dim)
        q = query.unsqueeze(2)  # [n, heads, 1, head_dim]
        mask = None
        if n == 1 and self.sliding_window is None:
            k, v = k[:, :max_len], v[:, :max_len]
        else:
            k_pos = torch.arange(padded, device=query.device)
            seq_lens = metadata.seq_lens[:n].unsqueeze(1)
            mask = k_pos.unsqueeze(0) < seq_lens
            if self.sliding_window is not None:
                mask &= k_pos.unsqueeze(0) >= seq_lens - self.sliding_window
            mask = mask[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2).to(query.dtype),
            v.transpose(1, 2).to(query.dtype),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=gqa,
        )
        return o.squeeze(2)
