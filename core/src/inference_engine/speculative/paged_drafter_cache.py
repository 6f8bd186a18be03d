"""A model drafter's own paged K/V cache, indexed by the target's block ids, and the plain
torch ops its one-layer drafters use (RMSNorm, neox rotary, paged causal attention).

The cache has the target pool's geometry (block size, block count) so a request's block
table addresses both: the scheduler's lookahead slots, preemption and frees serve the
drafter as well, and the pool's block count is sized from both caches' bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_engine.interfaces.attention import KVCacheSpec

__all__ = ["PagedDrafterCache", "rms_norm", "rope"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, back in ``x``'s dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-layout rotary of ``x [T, heads, head_dim]`` at ``positions [T]`` (float32 math)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    # angles: [T, dim / 2]
    angles = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    xf = x.float()
    a, b = xf[..., : dim // 2], xf[..., dim // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class PagedDrafterCache:
    """K and V ``[num_blocks, block_size, kv_heads, head_dim]`` of one drafter layer."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(2, self.num_kv_heads, self.head_dim, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              block_tables: Sequence[Sequence[int]], rows_per_seq: Sequence[int]) -> None:
        """Store rows' K/V ``[T, kv_heads, head_dim]`` at their positions."""
        if not len(positions):
            return
        tables = [torch.tensor(list(b), dtype=torch.int64, device=self.device)
                  for b in block_tables]
        owner = torch.repeat_interleave(torch.arange(len(tables), device=self.device),
                                        torch.tensor(list(rows_per_seq), device=self.device))
        index = torch.div(positions, self.block_size, rounding_mode="floor")
        width = max(len(t) for t in tables)
        padded = torch.zeros(len(tables), width, dtype=torch.int64, device=self.device)
        for i, t in enumerate(tables):
            padded[i, : len(t)] = t
        slot_blocks = padded[owner, index]
        slot_offsets = positions % self.block_size
        self.k[slot_blocks, slot_offsets] = k.to(self.dtype)
        self.v[slot_blocks, slot_offsets] = v.to(self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, block_tables: Sequence[Sequence[int]],
               rows_per_seq: Sequence[int], causal: bool = True) -> torch.Tensor:
        """Write each row's K/V at its position, then attend each sequence's rows to its
        cached positions (causally, or to every row of its block when ``causal`` is off).

        Args:
            q: ``[T, heads, head_dim]``; k, v: ``[T, kv_heads, head_dim]``.
            positions: ``[T]``, each sequence's rows in order.
            block_tables: per sequence, its block ids (the target's).
            rows_per_seq: rows of each sequence, laid end to end.

        Returns:
            ``[T, heads, head_dim]``.
        """
        bs = self.block_size
        self.write(k, v, positions, block_tables, rows_per_seq)
        out = torch.empty_like(q)
        pos_host = positions.tolist()
        start = 0
        for blocks, n in zip(block_tables, rows_per_seq, strict=True):
            rows = slice(start, start + n)
            pos = pos_host[start : start + n]
            table = torch.tensor(list(blocks), dtype=torch.int64, device=self.device)
            p = positions[rows]
            length = max(pos) + 1
            num_blocks = -(-length // bs)
            # keys, values: [length, kv_heads, head_dim]
            keys = self.k[table[:num_blocks]].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
            values = self.v[table[:num_blocks]].reshape(-1, self.num_kv_heads,
                                                        self.head_dim)[:length]
            group = q.shape[1] // self.num_kv_heads
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()
            values = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
            key_pos = torch.arange(length, device=self.device)
            if causal:
                mask = key_pos[None, :] <= p[:, None]
            else:  # the rows' own block is visible to all of them, the context before too
                mask = key_pos[None, :] <= p.max()
            out[rows] = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1).float(), keys, values, attn_mask=mask[None]
            ).transpose(0, 1).to(q.dtype)
            start += n
        return out
