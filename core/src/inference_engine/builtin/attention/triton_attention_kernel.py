"""Triton kernels over the paged KV pool: the cache write, one attention launch for a
whole mixed batch, and the reduce of a split-KV (flash-decoding) launch.

The attention kernel's programs are (query block, KV head[, split]). A query block is
up to ``BLOCK_Q`` consecutive query tokens of one sequence times the ``GROUP`` query
heads that share the KV head, so each K/V tile is read once for all of them (GQA). A
program finds its sequence by a binary search of ``query_start_loc`` on the device,
reads the sequence's length there, and loops only over the key tiles its queries can
see (causal, within the window), fetching K/V in place through the block table. The
grid is sized from host ints alone, so the launch never waits on the device and can
be captured in a CUDA graph.

With ``num_splits > 1`` the key range is cut into that many pieces handled by separate
programs, which store partial (max, sum, accumulator) triples; ``_reduce_kernel``
merges them. That keeps the GPU busy on decode steps with few, long sequences.

:mod:`inference_engine.builtin.attention.attention_reference` computes the same in
plain torch; the tests hold the two together under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from inference_engine.kernel_tuning import tuning_config

__all__ = ["default_config", "launch_config", "paged_attention", "write_kv_cache"]

# Largest finite float8_e4m3fn value: quantised writes saturate here instead of overflowing.
FP8_E4M3_MAX = tl.constexpr(448.0)


def _pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= ``max(n, least)``."""
    return max(least, triton.next_power_of_2(n))


# --------------------------------------------------------------------------- #
# Cache write
# --------------------------------------------------------------------------- #


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale, v_scale, num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """One token's K and V rows (every KV head) into their slot; slots < 0 are padding."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    if QUANTIZED:
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + h * stride_kc_h + d
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + h * stride_vc_h + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots.

    The caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` views with any
    block stride (the pool interleaves layers). A float8_e4m3fn cache receives
    ``clamp(x / scale)``; the scales are ignored for other dtypes.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale, v_scale, num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEADS_PAD=_pow2(num_kv_heads), HEAD_PAD=_pow2(head_dim),
        QUANTIZED=k_cache.dtype == torch.float8_e4m3fn,
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels address the head dimension with unit stride (vectorised loads).
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------- #
# Attention
# --------------------------------------------------------------------------- #


@triton.jit
def _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query block ``q_block``: the last ``i`` whose first block
    ``query_start[i] // BLOCK_Q + i`` is <= ``q_block`` (each sequence gets one spare
    block, so the grid bound ``num_tokens // BLOCK_Q + num_seqs`` is host-computable)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs would otherwise go through TF32 on NVIDIA GPUs (10-bit mantissa).
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    sinks_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, softcap, k_scale, v_scale, window, num_seqs, num_heads, head_dim, keys_per_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_PAD: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    QUANTIZED: tl.constexpr, IEEE: tl.constexpr,
):
    """Online-softmax attention of one query block against one KV head's context."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    first_q = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # The new tokens are the last q_len of the context (a padding row: -1, sees nothing).
    context_len = seq_len - q_len

    # Rows are (query token, head in the group) pairs, token-major.
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < head_dim
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys the block's queries can see: up to its last query, from its first query's window.
    key_end = context_len + tl.minimum(first_q + BLOCK_Q, q_len)
    key_start = 0
    if HAS_WINDOW:
        key_start = tl.maximum(context_len + first_q - window + 1, 0)
    if NUM_SPLITS > 1:
        key_start = tl.maximum(key_start, split * keys_per_split)
        # The last split runs to the end, whatever the host's bound on the context was.
        key_end = tl.where(split < NUM_SPLITS - 1,
                           tl.minimum(key_end, (split + 1) * keys_per_split), key_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink is one more logit in the denominator with no value: start the running
        # softmax from it (in split 0 only, so the reduce counts it once).
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    qk_scale = scale
    if QUANTIZED:
        qk_scale = scale * k_scale

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(key_start, key_end, TILE_N):
        k_pos = tile_start + tl.arange(0, TILE_N)
        k_ok = k_pos < key_end
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k_off = block * stride_kc_b + in_block * stride_kc_s + kv_head * stride_kc_h
        v_off = block * stride_vc_b + in_block * stride_vc_s + kv_head * stride_vc_h
        # k: [HEAD_PAD, TILE_N], v: [TILE_N, HEAD_PAD]
        k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None],
                    mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        s = _dot(q, k.to(q.dtype), IEEE) * qk_scale
        if HAS_SOFTCAP:
            # cap * tanh(s / cap), with tanh through exp (no tanh in tl's portable set);
            # saturates cleanly: exp overflow gives 1, underflow -1.
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing seen yet keeps -inf; subtracting 0 avoids -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), IEEE)
        m_i = m_new
    if QUANTIZED:
        acc = acc * v_scale

    if NUM_SPLITS > 1:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc,
                 mask=row_ok[:, None])
    else:
        # A row that saw no key (a padding row) has l = 0 and acc = 0: output zeros.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_heads, head_dim, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """Merge one (token, head)'s split partial softmaxes into its output row."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, HEAD_PAD)
    part = (token * num_heads + head) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l_part = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], mask=s_ok[:, None],
                  other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(l_part * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


def default_config(shape: dict[str, int]) -> dict[str, Any]:
    """Launch parameters when no plugin answers: 16 rows for decode-only steps (a GQA
    group or two), 64 for prefills; narrower key tiles for wide heads (registers)."""
    block_m = 16 if shape["max_query_len"] <= 1 else 64
    return {"BLOCK_M": max(block_m, _pow2(shape["group"])),
            "TILE_N": 64 if shape["head_pad"] <= 128 else 32, "num_warps": 4, "num_stages": 2}


def launch_config(shape: dict[str, int]) -> dict[str, Any]:
    """The ``ie_kernel_tuning_config`` answer for op ``"triton_attention"`` (shape keys
    ``head_pad``, ``group``, ``max_query_len`` (1 for decode-only steps, else 2)), or
    the default."""
    return tuning_config("triton_attention", shape, default_config(shape))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int = 1,
    keys_per_split: int = 0,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Causal attention of a flat mixed batch over the paged cache; ``[T, H, D]`` out.

    Same contract as
    :func:`~inference_engine.builtin.attention.attention_reference.paged_attention_reference`
    for the tensors and options. Launch arguments, all host ints:

    Args:
        max_query_len: an upper bound on any sequence's query length; picks the tile.
        num_splits: key-range splits per query block (> 1 adds the reduce launch).
        keys_per_split: keys per split but the last (which runs to the end); a multiple
            of the key tile is best. Needed when ``num_splits > 1``.
        config: launch parameters; None: :func:`launch_config`'s answer.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = query_start_loc.shape[0] - 1
    head_pad = _pow2(head_dim, 16)
    if config is None:
        config = launch_config({"head_pad": head_pad, "group": group,
                                "max_query_len": min(max_query_len, 2)})
    block_m = config["BLOCK_M"]
    block_q = block_m // group
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    query = _last_dim_contiguous(query)
    if num_splits > 1:
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                             device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_pad,
                               dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        sinks if sinks is not None else out, part_m, part_l, part_acc,
        scale, softcap or 0.0, k_scale, v_scale, sliding_window or 0, num_seqs, num_heads,
        head_dim, keys_per_split,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_PAD=head_pad,
        TILE_N=config["TILE_N"], BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=num_splits,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None, QUANTIZED=k_cache.dtype == torch.float8_e4m3fn,
        IEEE=query.dtype == torch.float32,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    if num_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, num_heads, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits), HEAD_PAD=head_pad,
        )
    return out
