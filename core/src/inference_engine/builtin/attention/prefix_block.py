"""The "cached prefix + bidirectional block" attention mode (block diffusion's decoder).

Each sequence's queries are a block (canvas) that follows its cached prefix; they
attend to the prefix, read from the paged cache, and to the whole block,
non-causally. The block's own K/V are scratch: they are used for this pass only and
never written to the cache (so they can never be prefix-cached either). A sliding
layer sees only the last ``sliding_window - 1`` prefix tokens (what transformers'
sliding cache keeps) plus the whole block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_engine.builtin.attention.attention_reference import dequantize
from inference_engine.builtin.attention.common import gather_context
from inference_engine.interfaces.attention import AttentionMetadata

__all__ = ["PrefixBlockAttention", "attend_prefix_block"]


def _read(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if cached.dtype == torch.float8_e4m3fn:
        return dequantize(cached, scale).to(dtype)
    return cached.to(dtype)


def attend_prefix_block(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attend each block to its cached prefix plus itself; returns ``[T, heads * head_dim]``.

    Args:
        query: ``[T, num_heads, head_dim]`` of every block, laid end to end.
        key, value: ``[T, num_kv_heads, head_dim]`` of the blocks (scratch, not stored).
        kv_cache: the layer's (k_cache, v_cache), read only.
        metadata: ``seq_lens_list[i]`` is sequence i's *cached prefix* length,
            ``query_lens_list[i]`` its block length.
        scale: softmax scale.
        sliding_window: the layer's window, or None (full attention).
    """
    k_cache, v_cache = kv_cache
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (prefix_len, block_len) in enumerate(
            zip(metadata.seq_lens_list, metadata.query_lens_list, strict=True)):
        end = start + block_len
        first = 0 if sliding_window is None else max(0, prefix_len - (sliding_window - 1))
        k, v = key[start:end], value[start:end]
        if prefix_len > 0:
            table = metadata.block_tables[i]
            k_prefix = gather_context(k_cache, table, prefix_len, metadata.block_size)[first:]
            v_prefix = gather_context(v_cache, table, prefix_len, metadata.block_size)[first:]
            k = torch.cat((_read(k_prefix, k_scale, query.dtype), k), dim=0)
            v = torch.cat((_read(v_prefix, v_scale, query.dtype), v), dim=0)
        # [1, heads, len, head_dim]: SDPA's fused CPU path wants 4-d inputs.
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=False, scale=scale,
            enable_gqa=k.shape[1] != num_heads)
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out.view(query.shape[0], num_heads * head_dim)


class PrefixBlockAttention:
    """Mixin giving an attention backend the gather + SDPA "cached prefix + bidirectional
    block" mode (``AttentionBackend.forward_prefix_block``) over the pool's cache layout."""

    def forward_prefix_block(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             kv_cache: tuple[torch.Tensor, torch.Tensor],
                             metadata: AttentionMetadata) -> torch.Tensor:
        return attend_prefix_block(query, key, value, kv_cache, metadata, self.scale,
                                   self.sliding_window, self.k_scale, self.v_scale)
