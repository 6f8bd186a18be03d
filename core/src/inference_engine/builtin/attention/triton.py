"""Portable Triton attention over the paged pool: one launch per layer for a mixed batch.

Each layer's step is a cache-write launch and one attention launch covering every
decode row and prefill chunk (plus a small reduce launch when a decode-only step is
split over the context, flash-decoding style). Launch sizes come from host ints only
(the tensors' shapes and the metadata's host bounds), so a step never synchronises
with the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from inference_engine.builtin.attention.prefix_block import PrefixBlockAttention
from inference_engine.builtin.attention.triton_attention_kernel import (
    paged_attention,
    write_kv_cache,
)
from inference_engine.interfaces.attention import AttentionBackend, AttentionMetadata

__all__ = ["TritonAttentionBackend"]

# Programs that keep a large GPU busy; decode steps with fewer (seq, KV head) pairs than
# this are split over their context until they reach it.
TARGET_PROGRAMS = 256
# A split gets at least this many keys: below that the reduce costs more than it saves.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32
# Splits are cut at multiples of this (the widest key tile), so no tile straddles two.
SPLIT_ALIGN = 64


def plan_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int,
                   max_seq_len: int) -> tuple[int, int]:
    """(num_splits, keys_per_split) for a step, from host ints only.

    Only decode-only steps split: a prefill chunk brings enough query blocks of its
    own. The split count fills about ``TARGET_PROGRAMS`` programs without giving a
    split fewer than ``MIN_KEYS_PER_SPLIT`` keys.
    """
    if max_query_len != 1 or num_seqs == 0:
        return 1, 0
    by_occupancy = TARGET_PROGRAMS // (num_seqs * num_kv_heads)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    num_splits = min(MAX_SPLITS, by_occupancy, by_length)
    if num_splits <= 1:
        return 1, 0
    keys_per_split = -(-max_seq_len // num_splits)
    keys_per_split = -(-keys_per_split // SPLIT_ALIGN) * SPLIT_ALIGN
    return num_splits, keys_per_split


class TritonAttentionBackend(PrefixBlockAttention, AttentionBackend):
    """Paged attention through Triton kernels, reading K/V in place through the block table.

    Supports GQA/MQA, sliding windows, attention sinks, a logit soft-cap and float32,
    bfloat16, float16 or float8_e4m3fn caches (float8 with the per-tensor ``k_scale``
    and ``v_scale``: stored values are ``x / scale``).
    """

    name = "triton"
    supports_sinks = True
    supports_sliding_window = True
    graph_safe = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(num_heads, head_dim, num_kv_heads, scale, sliding_window)
        # Logit soft-cap: scores become ``softcap * tanh(score / softcap)``; None for none.
        self.softcap = softcap

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        # Heads are padded to a power of two (masked); past 256 the tiles outgrow registers.
        return 0 < head_dim <= 256

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)

    def prepare(self, device: torch.device, kv_dtype: torch.dtype) -> None:
        """Check the cache dtype; the kernels compile on first use per shape.

        Raises:
            ValueError: ``kv_dtype`` is not one the kernels read.
        """
        if not self.supports_kv_cache_dtype(kv_dtype):
            raise ValueError(f"the triton attention backend cannot use a {kv_dtype} KV cache")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, self.k_scale,
                       self.v_scale)
        # Host bounds only: the runner's, else the host lists' (never a device read).
        num_seqs = metadata.query_start_loc.shape[0] - 1
        max_query_len = metadata.max_query_len or max(metadata.query_lens_list, default=0)
        max_seq_len = metadata.max_seq_len or max(metadata.seq_lens_list, default=0)
        num_splits, keys_per_split = plan_kv_splits(num_seqs, self.num_kv_heads, max_query_len,
                                                    max_seq_len)
        out = paged_attention(
            query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, self.scale, max_query_len=max_query_len,
            sliding_window=self.sliding_window, sinks=self.sinks, softcap=self.softcap,
            k_scale=self.k_scale, v_scale=self.v_scale, num_splits=num_splits,
            keys_per_split=keys_per_split,
        )
        return out.view(query.shape[0], self.num_heads * self.head_dim)
