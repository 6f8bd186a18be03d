"""Triton kernel for DeepSeek-V4's decode attention: one K=V head, per-head sinks, per-query keys.

The same contract as :func:`~inference_engine.layers.compressed_attention.sink_attention`
with one key set per query (``keys [n, S, D]``, ``mask [n, S]``): each program takes
one query and a block of ``BLOCK_H`` heads, streams the query's keys in blocks of
``BLOCK_N`` with an online softmax (float32, IEEE dots), and folds the sink logit
into the denominator at the end. The keys are read once per head block instead of
materialising ``[n, H, S]`` scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sink_attention_triton"]


@triton.jit
def _sink_attention_kernel(q_ptr, k_ptr, mask_ptr, sink_ptr, out_ptr, num_heads, num_keys,
                           head_dim, scale, stride_qn, stride_qh, stride_kn, stride_ks,
                           stride_mn, stride_on, stride_oh, BLOCK_H: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr) -> None:
    i = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + i * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    # NOTE: a finite start keeps exp(m_old - m_new) defined while a block is fully masked.
    m = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        in_range = offs < num_keys
        visible = tl.load(mask_ptr + i * stride_mn + offs, mask=in_range, other=0) != 0
        keys = tl.load(k_ptr + i * stride_kn + offs[:, None] * stride_ks + dims[None, :],
                       mask=visible[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, keys, input_precision="ieee")
        m = m_new
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    m_all = tl.maximum(m, sink)
    keep = tl.exp(m - m_all)
    out = acc * keep[:, None] / (denom * keep + tl.exp(sink - m_all))[:, None]
    tl.store(out_ptr + i * stride_on + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


def sink_attention_triton(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                          sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`~inference_engine.layers.compressed_attention.sink_attention` for per-query keys.

    Args:
        q: ``[n, H, D]``.
        keys: ``[n, S, D]`` (also the values).
        mask: ``[n, S]`` bool.
        sinks: ``[H]``.
        scale: softmax scale.

    Returns:
        ``[n, H, D]`` in ``q``'s dtype.
    """
    if keys.dim() != 3:
        raise ValueError("sink_attention_triton takes one key set per query ([n, S, D])")
    n, h, d = q.shape
    q = q.contiguous()
    keys = keys.contiguous()
    flags = mask.to(torch.int8).contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    block_h = 16
    block_d = max(16, triton.next_power_of_2(d))
    grid = (n, triton.cdiv(h, block_h))
    _sink_attention_kernel[grid](
        q, keys, flags, sinks.float().contiguous(), out, h, keys.shape[1], d, scale,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), flags.stride(0),
        out.stride(0), out.stride(1), BLOCK_H=block_h, BLOCK_N=16, BLOCK_D=block_d)
    return out
