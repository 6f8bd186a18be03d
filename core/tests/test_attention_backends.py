"""Both built-in backends against plain causal attention over each sequence's full K/V."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from inference_engine.builtin.attention import cpu_paged as paged
from inference_engine.builtin.attention.cpu_decode_kernel import decode_kernel
from inference_engine.builtin.attention.cpu_paged import CpuPagedAttentionBackend
from inference_engine.builtin.attention.torch_sdpa import TorchSDPABackend
from inference_engine.interfaces.attention import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def reference(q, k, v, sliding_window=None):
    """Textbook softmax(QK^T * scale + causal) V with repeated KV heads; q is the tail of k."""
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    qlen, klen = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    qpos = torch.arange(klen - qlen, klen)[:, None]
    kpos = torch.arange(klen)[None, :]
    allowed = kpos <= qpos
    if sliding_window:
        allowed &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(qlen, HEADS * DIM)


def strided_pool(num_blocks):
    """Per-layer K/V views into a block-contiguous pool, as the cache manager builds them."""
    per = BLOCK * KV_HEADS * DIM
    pool = torch.zeros(num_blocks, 3 * 2 * per)  # three "layers" in each block
    k = pool[:, 2 * per : 3 * per].view(num_blocks, BLOCK, KV_HEADS, DIM)
    v = pool[:, 3 * per : 4 * per].view(num_blocks, BLOCK, KV_HEADS, DIM)
    return k, v


def check_batch(backend, shapes, num_decodes, sliding_window=None, seed=0):
    """Fill a pool with each (cached, new) sequence's context, run one step, compare."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in shapes) + 2
    perm = torch.randperm(num_blocks - 1) + 1
    k_cache, v_cache = strided_pool(num_blocks)
    full_k, full_v, tables, qs, ks, vs, slots = [], [], [], [], [], [], []
    next_block = 0
    for cached, new in shapes:
        total = cached + new
        nblocks = -(-total // BLOCK)
        table = perm[next_block : next_block + nblocks]
        next_block += nblocks
        tables.append(table)
        kk = torch.randn(total, KV_HEADS, DIM)
        vv = torch.randn(total, KV_HEADS, DIM)
        full_k.append(kk)
        full_v.append(vv)
        for pos in range(total):
            b, o = table[pos // BLOCK], pos % BLOCK
            if pos < cached:
                k_cache[b, o], v_cache[b, o] = kk[pos], vv[pos]
            else:
                slots.append(int(b) * BLOCK + o)
        qs.append(torch.randn(new, HEADS, DIM))
        ks.append(kk[cached:])
        vs.append(vv[cached:])
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.zeros(len(shapes), max_blocks, dtype=torch.long)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    qlens = [n for _, n in shapes]
    seq_lens = [c + n for c, n in shapes]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.long)
    md = AttentionMetadata(
        num_tokens=sum(qlens),
        num_decodes=num_decodes,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens),
        slot_mapping=torch.tensor(slots),
        block_tables=block_tables,
        block_size=BLOCK,
        query_lens_list=qlens,
        seq_lens_list=seq_lens,
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
    )
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), (k_cache, v_cache), md)
    for i in range(len(shapes)):
        expect = reference(qs[i], full_k[i], full_v[i], sliding_window)
        got = out[qsl[i] : qsl[i + 1]]
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    # The new tokens were written into the cache at their slots.
    for i, table in enumerate(tables):
        for pos in range(shapes[i][0], seq_lens[i]):
            torch.testing.assert_close(k_cache[table[pos // BLOCK], pos % BLOCK], full_k[i][pos])
    return md


@pytest.fixture
def torch_decode_path(monkeypatch):
    """Make the paged backend use its gather + SDPA decode path, not the CPU kernel."""
    monkeypatch.setattr(paged, "paged_decode_attention", lambda *args: None)


@pytest.mark.parametrize("backend_cls", [TorchSDPABackend, CpuPagedAttentionBackend, "paged-torch"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_mixed_batch_matches_reference(backend_cls, sliding_window, request):
    # (cached context, new tokens): two decodes, a fresh prefill, a chunk after cached context.
    shapes = [(6, 1), (1, 1), (0, 7), (5, 4)]
    if backend_cls == "paged-torch":
        request.getfixturevalue("torch_decode_path")
        backend_cls = CpuPagedAttentionBackend
    backend = backend_cls(HEADS, DIM, KV_HEADS, 1 / math.sqrt(DIM), sliding_window)
    check_batch(backend, shapes, 2, sliding_window)


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_cpu_decode_kernel_matches_reference(sliding_window):
    """The C++ kernel reads blocks in place from the strided pool, long and short contexts."""
    assert decode_kernel() is not None, "the CPU decode kernel failed to build (see the log)"
    shapes = [(c, 1) for c in (0, 3, 40, 17, 64, 9, 1, 33)]
    backend = CpuPagedAttentionBackend(HEADS, DIM, KV_HEADS, 1 / math.sqrt(DIM), sliding_window)
    check_batch(backend, shapes, len(shapes), sliding_window, seed=5)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_decodes_grouped_by_length_match_reference(monkeypatch, torch_decode_path,
                                                   sliding_window):
    """Decodes of very different lengths split into several groups, plus a prefill after them."""
    monkeypatch.setattr(paged, "GROUP_SPLIT_MIN_SAVING", 0)
    shapes = [(3, 1), (40, 1), (0, 1), (17, 1), (41, 1), (9, 1), (25, 1), (0, 6)]
    backend = CpuPagedAttentionBackend(HEADS, DIM, KV_HEADS, 1 / math.sqrt(DIM), sliding_window)
    md = check_batch(backend, shapes, 7, sliding_window, seed=3)
    assert len(md.backend_cache["paged_decode_groups"]) > 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([1, 4, 16]),
       st.integers(0, 2000))
def test_decode_groups_partition_rows(lens, block_size, min_saving):
    groups = paged.plan_decode_groups(lens, block_size, min_saving)
    rows = np.concatenate(groups)
    assert sorted(rows.tolist()) == list(range(len(lens)))
    # Groups run longest first and never overlap in length.
    maxima = [max(lens[i] for i in g) for g in groups]
    minima = [min(lens[i] for i in g) for g in groups]
    assert all(lo >= hi for lo, hi in zip(minima, maxima[1:], strict=False))
    if min_saving >= 300 * len(lens):
        assert len(groups) == 1


def test_single_decode_fast_path():
    torch.manual_seed(1)
    k_cache, v_cache = strided_pool(8)
    kk, vv = torch.randn(10, KV_HEADS, DIM), torch.randn(10, KV_HEADS, DIM)
    table = torch.tensor([5, 2, 7])
    for pos in range(9):
        k_cache[table[pos // BLOCK], pos % BLOCK] = kk[pos]
        v_cache[table[pos // BLOCK], pos % BLOCK] = vv[pos]
    q = torch.randn(1, HEADS, DIM)
    md = AttentionMetadata(
        num_tokens=1, num_decodes=1, query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([10]), slot_mapping=torch.tensor([7 * BLOCK + 1]),
        block_tables=table[None], block_size=BLOCK, query_lens_list=[1], seq_lens_list=[10],
    )
    backend = CpuPagedAttentionBackend(HEADS, DIM, KV_HEADS, 1 / math.sqrt(DIM))
    out = backend.forward(q, kk[9:], vv[9:], (k_cache, v_cache), md)
    torch.testing.assert_close(out, reference(q, kk, vv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("runner", ["pool", "aten"])
def test_cpu_decode_kernel_long_contexts_on_either_thread_pool(runner):
    """Enough work to split across threads, whichever threads run the tasks."""
    from inference_engine import cpu_thread_pool

    module = decode_kernel()
    assert module is not None
    if runner == "pool" and cpu_thread_pool.thread_pool() is None:
        pytest.skip("the pool did not build")
    with cpu_thread_pool.kernel_runner(module, use_pool=runner == "pool"):
        shapes = [(c, 1) for c in (4100, 3000, 7, 2000)]  # > 2^18 multiply-adds
        backend = CpuPagedAttentionBackend(HEADS, DIM, KV_HEADS, 1 / math.sqrt(DIM), None)
        check_batch(backend, shapes, len(shapes), None, seed=11)


def _bf16_pool(num_blocks, kv_heads, dim, block=BLOCK):
    """bfloat16 per-layer views into a block-contiguous pool (two layers per block)."""
    per = block * kv_heads * dim
    pool = torch.zeros(num_blocks, 2 * 2 * per, dtype=torch.bfloat16)
    k = pool[:, 2 * per : 3 * per].view(num_blocks, block, kv_heads, dim)
    v = pool[:, 3 * per : 4 * per].view(num_blocks, block, kv_heads, dim)
    return k, v


@pytest.mark.parametrize("dim", [64, 128, 24])  # 24: the kernel's plain-loop path
@pytest.mark.parametrize("sliding_window", [None, 9])
def test_cpu_decode_kernel_reads_a_bfloat16_cache(dim, sliding_window):
    """A bfloat16 cache: the kernel equals the torch gather path on the same bf16 values."""
    from inference_engine.builtin.attention.cpu_decode_kernel import paged_decode_attention

    assert decode_kernel() is not None
    torch.manual_seed(dim)
    heads, kv_heads, block = 6, 2, 16
    lens = [1, 17, 40, 95, 3]
    nblocks = [-(-n // block) for n in lens]
    num_blocks = sum(nblocks) + 1
    k_cache, v_cache = _bf16_pool(num_blocks, kv_heads, dim, block)
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(lens), max(nblocks), dtype=torch.long)
    at = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = torch.tensor(perm[at : at + nb])
        at += nb
    q = torch.randn(len(lens), heads, dim)
    scale = dim**-0.5
    got = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), scale,
                                 sliding_window)
    assert got is not None
    for i, n in enumerate(lens):
        k = k_cache[tables[i]].reshape(-1, kv_heads, dim)[:n].float()
        v = v_cache[tables[i]].reshape(-1, kv_heads, dim)[:n].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k.double()) * scale
        if sliding_window is not None:
            scores[:, : max(0, n - sliding_window)] = float("-inf")
        expect = torch.einsum("hk,khd->hd", scores.softmax(-1), v.double())
        torch.testing.assert_close(got[i].double(), expect, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cache_write_kernel_equals_indexed_assignment(cache_dtype):
    """write_kv_rows stores strided rows exactly as ``cache[b, o] = x.to(dtype)`` does."""
    from inference_engine.builtin.attention.cpu_decode_kernel import write_kv_rows

    torch.manual_seed(2)
    k_cache, v_cache = _bf16_pool(12, KV_HEADS, DIM)
    if cache_dtype == torch.float32:
        k_cache, v_cache = strided_pool(12)
    fused = torch.randn(7, 3 * KV_HEADS * DIM)  # key and value are views into one row
    key = fused[:, : KV_HEADS * DIM].view(7, KV_HEADS, DIM)
    value = fused[:, 2 * KV_HEADS * DIM :].view(7, KV_HEADS, DIM)
    key[0, 0, 0] = 1 + 2**-8  # a tie: rounds to even
    key[0, 0, 1] = 1 + 3 * 2**-8
    key[0, 0, 2] = float("nan")
    key[0, 0, 3] = float("inf")
    value[1, 0, :3] = torch.tensor([-float("inf"), 3.0e38, -1e-40])
    blocks = torch.tensor([3, 3, 5, 11, 1, 7, 7])
    offsets = torch.tensor([0, 3, 2, 1, 0, 3, 2])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k[blocks, offsets] = key.to(cache_dtype)
    expect_v[blocks, offsets] = value.to(cache_dtype)
    assert write_kv_rows(k_cache, v_cache, key, value, blocks, offsets)
    # Bit for bit, but any NaN payload (torch's vectorised cast writes 0xFFFF, its scalar
    # one 0x7FC0).
    torch.testing.assert_close(k_cache, expect_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expect_v, atol=0, rtol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="slot out of range"):
        write_kv_rows(k_cache, v_cache, key, value, blocks + 20, offsets)


def test_paged_backend_with_a_bfloat16_cache_matches_reference():
    """A mixed step (decodes, a fresh prefill, a chunk after cached context) on a bf16 cache
    through the torch paths (8-dim heads), against attention over the bf16-rounded K/V."""
    torch.manual_seed(4)
    shapes = [(6, 1), (33, 1), (0, 7), (5, 4)]
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in shapes) + 2
    k_cache, v_cache = _bf16_pool(num_blocks, KV_HEADS, DIM)
    backend = CpuPagedAttentionBackend(HEADS, DIM, KV_HEADS, 1 / math.sqrt(DIM), None)
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, qs, ks, vs, full, slots, at = [], [], [], [], [], [], 0
    for cached, new in shapes:
        nb = -(-(cached + new) // BLOCK)
        table = perm[at : at + nb]
        at += nb
        tables.append(table)
        kk, vv = torch.randn(cached + new, KV_HEADS, DIM), torch.randn(cached + new, KV_HEADS, DIM)
        for pos in range(cached + new):
            b, o = table[pos // BLOCK], pos % BLOCK
            if pos < cached:
                k_cache[b, o], v_cache[b, o] = kk[pos].bfloat16(), vv[pos].bfloat16()
            else:
                slots.append(b * BLOCK + o)
        full.append((kk, vv, cached))
        qs.append(torch.randn(new, HEADS, DIM))
        ks.append(kk[cached:])
        vs.append(vv[cached:])
    block_tables = torch.zeros(len(shapes), max(len(t) for t in tables), dtype=torch.long)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    qlens = [n for _, n in shapes]
    seq_lens = [c + n for c, n in shapes]
    md = AttentionMetadata(
        num_tokens=sum(qlens), num_decodes=2,
        query_start_loc=torch.tensor([0, *np.cumsum(qlens).tolist()]),
        seq_lens=torch.tensor(seq_lens), slot_mapping=torch.tensor(slots),
        block_tables=block_tables, block_size=BLOCK, query_lens_list=qlens,
        seq_lens_list=seq_lens, max_decode_seq_len=max(seq_lens[:2]),
    )
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), (k_cache, v_cache), md)
    start = 0
    for i, (kk, vv, _) in enumerate(full):
        n = qlens[i]
        # Every path (fresh prefills too) attends the cache's bf16-rounded values.
        expect = reference(qs[i], kk.bfloat16().float(), vv.bfloat16().float())
        torch.testing.assert_close(out[start : start + n], expect, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block", [(8, 4, 64, 16), (4, 4, 32, 4),
                                                      (8, 2, 128, 16), (6, 1, 64, 8),
                                                      (4, 2, 48, 16), (6, 2, 96, 8)])
@pytest.mark.parametrize("sliding_window", [None, 21])
def test_cpu_prefill_kernel_matches_causal_attention(cache_dtype, heads, kv_heads, dim, block,
                                                     sliding_window):
    """Fresh prompts and chunks after cached context, read from a scattered cache."""
    from inference_engine.builtin.attention.cpu_prefill_kernel import (
        paged_prefill_attention,
        prefill_kernel,
    )

    if prefill_kernel() is None:
        pytest.skip("the prefill kernel needs AVX-512 or AVX2 with FMA")
    torch.manual_seed(dim + block)
    chunks = [(0, 1), (0, 45), (37, 9), (5, 70), (0, 16), (130, 3)]  # (cached, new) tokens
    lens = [c + n for c, n in chunks]
    nblocks = [-(-n // block) for n in lens]
    num_blocks = sum(nblocks) + 1
    per = block * kv_heads * dim
    pool = torch.zeros(num_blocks, 4 * per, dtype=cache_dtype)  # two layers per block
    k_cache = pool[:, 2 * per : 3 * per].view(num_blocks, block, kv_heads, dim)
    v_cache = pool[:, 3 * per :].view(num_blocks, block, kv_heads, dim)
    k_cache.copy_(torch.randn(k_cache.shape) * 2)
    v_cache.copy_(torch.randn(v_cache.shape))
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(chunks), max(nblocks) + 2, dtype=torch.long)
    at = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = torch.tensor(perm[at : at + nb])
        at += nb
    qlens = [n for _, n in chunks]
    query = torch.randn(sum(qlens), heads, dim)
    scale = dim**-0.5
    got = paged_prefill_attention(query, k_cache, v_cache, tables, qlens, lens, scale,
                                  sliding_window)
    assert got is not None and got.shape == query.shape
    start = 0
    for i, ((cached, new), n) in enumerate(zip(chunks, lens, strict=True)):
        k = k_cache[tables[i, : nblocks[i]]].reshape(-1, kv_heads, dim)[:n].double()
        v = v_cache[tables[i, : nblocks[i]]].reshape(-1, kv_heads, dim)[:n].double()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        q = query[start : start + new].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(cached, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        expect = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(got[start : start + new].double(), expect, atol=2e-5, rtol=2e-5)
        start += new


def test_prefill_kernel_refuses_what_it_cannot_do():
    from inference_engine.builtin.attention.cpu_prefill_kernel import paged_prefill_attention

    k_cache = torch.zeros(4, 16, 2, 40)  # head size 40: no instance
    q = torch.randn(3, 4, 40)
    assert paged_prefill_attention(q, k_cache, k_cache, torch.zeros(1, 1, dtype=torch.long), [3],
                                   [3], 0.1, None) is None


@pytest.mark.parametrize("sliding_window", [None, 11])
def test_paged_backend_prefills_through_the_kernel(monkeypatch, sliding_window):
    """Head size 64 (a kernel instance): a mixed step through the backend against reference."""
    import sys

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "DIM", 64)
    monkeypatch.setattr(module, "BLOCK", 16)
    shapes = [(6, 1), (40, 1), (0, 37), (20, 9), (0, 1)]
    backend = CpuPagedAttentionBackend(HEADS, 64, KV_HEADS, 1 / 8, sliding_window)
    check_batch(backend, shapes, 2, sliding_window, seed=9)
