"""Triton sparse MLA decode: each query attends only its selected latents, read in place.

One program per (decode sequence, block of ``BLOCK_H`` heads). It walks the
sequence's selected positions ``BLOCK_K`` at a time, maps each to its pool slot
through the block table, loads the ``[latent | rope key]`` entries straight from
the paged pool, and keeps an online softmax over ``[q_lat | q_pe] . entry``
with the latent part as the value (absorbed weights: the caller applies
``W_UV`` to the ``[n, H, rank]`` result). Every selected entry is read once
for all heads of the block.
:func:`~inference_engine.layers.sparse_mla.sparse_latent_attention_torch` is the
reference; the tests hold the two together under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sparse_latent_attention_triton"]


@triton.jit
def _sparse_mla_decode_kernel(q_ptr, cache_ptr, pos_ptr, table_ptr, out_ptr,
                              stride_cache_block, stride_cache_slot, stride_table,
                              num_heads, k, block_size, scale,
                              RANK: tl.constexpr, ROPE: tl.constexpr, RANK_P: tl.constexpr,
                              ROPE_P: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_K: tl.constexpr) -> None:
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    r = tl.arange(0, RANK_P)
    e = tl.arange(0, ROPE_P)
    q_row = q_ptr + (seq * num_heads + heads[:, None]).to(tl.int64) * (RANK + ROPE)
    q_lat = tl.load(q_row + r[None, :], mask=head_ok[:, None] & (r[None, :] < RANK), other=0.0)
    q_pe = tl.load(q_row + RANK + e[None, :], mask=head_ok[:, None] & (e[None, :] < ROPE),
                   other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, RANK_P), tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        pos = tl.load(pos_ptr + seq.to(tl.int64) * k + kk, mask=kk < k, other=-1)
        valid = pos >= 0
        pos = tl.maximum(pos, 0)
        block = tl.load(table_ptr + seq.to(tl.int64) * stride_table + pos // block_size)
        entry = block * stride_cache_block + (pos % block_size) * stride_cache_slot
        lat = tl.load(cache_ptr + entry[:, None] + r[None, :],
                      mask=valid[:, None] & (r[None, :] < RANK), other=0.0)
        rot = tl.load(cache_ptr + entry[:, None] + RANK + e[None, :],
                      mask=valid[:, None] & (e[None, :] < ROPE), other=0.0)
        s = (tl.dot(q_lat, tl.trans(lat).to(q_lat.dtype))
             + tl.dot(q_pe, tl.trans(rot).to(q_pe.dtype)))
        s = tl.where(valid[None, :], s.to(tl.float32) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.exp(s - shift[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat).to(tl.float32)
        m = m_new
    out = acc / denom[:, None]
    out_row = out_ptr + (seq * num_heads + heads[:, None]).to(tl.int64) * RANK
    tl.store(out_row + r[None, :], out, mask=head_ok[:, None] & (r[None, :] < RANK))


def sparse_latent_attention_triton(q: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                                   block_tables: torch.Tensor, rank: int,
                                   scale: float) -> torch.Tensor:
    """``[n, H, rank]`` float32 attention outputs over the selected latents.

    Args:
        q: ``[n, H, rank + rope]`` absorbed queries ``[q_lat | q_pe]``.
        cache: the layer's pool view ``[num_blocks, block_size, 1, rank + rope]``.
        positions: ``[n, k]`` selected positions per query, ``-1`` for none (at least one
            valid per row).
        block_tables: ``[n, max_blocks]`` each query's sequence's block ids.
    """
    n, heads, width = q.shape
    k = positions.shape[1]
    out = torch.empty(n, heads, rank, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    q = q.to(cache.dtype).contiguous()
    positions = positions.to(torch.int64).contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    block_h = 16
    grid = (n, triton.cdiv(heads, block_h))
    _sparse_mla_decode_kernel[grid](
        q, cache, positions, block_tables, out, cache.stride(0), cache.stride(1),
        block_tables.stride(0), heads, k, cache.shape[1], scale,
        RANK=rank, ROPE=width - rank, RANK_P=max(16, triton.next_power_of_2(rank)),
        ROPE_P=max(16, triton.next_power_of_2(width - rank)), BLOCK_H=block_h, BLOCK_K=32)
    return out
