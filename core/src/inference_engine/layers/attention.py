"""The attention layer: owns its KV cache views and delegates to the selected backend."""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import ModelContext

__all__ = ["Attention"]


class Attention(nn.Module):
    """Paged attention over this layer's cache; the runner binds ``kv_cache`` at start-up."""

    def __init__(self, ctx: ModelContext, num_heads: int, head_dim: int, num_kv_heads: int,
                 scale: float, prefix: str, sliding_window: int | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = ctx.dtype
        self.backend = ctx.attention_backend(num_heads, head_dim, num_kv_heads, scale, sliding_window)
        self.kv_cache: tuple[torch.Tensor, ...] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_tensors=2, num_heads=self.num_kv_heads, head_dim=self.head_dim,
                           dtype=self.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``q [T, H, D]``, ``k/v [T, KV, D]`` -> ``[T, H*D]``."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no KV cache bound; the runner allocates it")
        return self.backend.forward(q, k, v, self.kv_cache, metadata)
