"""Plain-torch reference of what the Triton attention kernels compute.

Paged attention for a flat mixed batch (decodes and prefill chunks after cached
context), with sliding window, attention sinks, logit soft-capping and per-tensor
float8 cache scales, plus the cache write including its quantisation. Written for
reading, one sequence at a time in float32; the kernel tests compare against it.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize", "paged_attention_reference", "quantize", "write_kv_cache_reference"]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as stored in a ``dtype`` cache: float8 gets ``clamp(x / scale)``, saturating at
    the largest finite value; other dtypes a plain cast (the scale does not apply)."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    fp8_max = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fp8_max, fp8_max).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values in float32: float8 entries times ``scale``, others as they are."""
    if x.dtype != torch.float8_e4m3fn:
        return x.float()
    return x.float() * scale


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at
    ``slot = block * block_size + offset``; tokens with a negative slot are skipped."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize(key[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize(value[keep], v_cache.dtype, v_scale)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the sequences' new tokens back to
            back; sequence ``i``'s are rows ``query_start_loc[i]:query_start_loc[i + 1]``
            and sit at the last positions of its ``seq_lens[i]`` context.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` physical block of each context block.
        seq_lens: ``[num_seqs]`` context length (cached + new). A row with context 0
            (CUDA-graph padding) attends nothing and outputs zeros.
        scale: multiplies ``q . k``.
        sliding_window: a query at position p sees keys at positions > p - window.
        sinks: ``[num_heads]`` logits that join each softmax's denominator, no value.
        softcap: scores become ``softcap * tanh(score / softcap)`` before masking.
        k_scale, v_scale: float8 caches hold values divided by these.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if seq_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks]
        # k, v: [seq_len, num_heads, head_dim], each KV head repeated for its query group.
        k = dequantize(k_cache[blocks].flatten(0, 1)[:seq_len], k_scale)
        v = dequantize(v_cache[blocks].flatten(0, 1)[:seq_len], v_scale)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()
        # scores: [num_heads, query_len, seq_len]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, end - start, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :seq_len]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
