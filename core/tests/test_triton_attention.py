"""The Triton attention backend against its torch reference and the torch_sdpa backend.

``triton.jit`` decides at import whether it interprets, so the kernel cases run in a
child pytest with ``TRITON_INTERPRET=1`` (as in the quant plugin's Triton tests); in
this process the wrapper and the host-only tests run. Everything is float32 (bf16 is
broken in the interpreter), on small mixed batches whose blocks are scattered through
a real two-layer :class:`KVCachePool`, so the per-layer views are strided.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from inference_engine.builtin.attention.attention_reference import (  # noqa: E402
    paged_attention_reference,
    quantize,
    write_kv_cache_reference,
)
from inference_engine.builtin.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from inference_engine.builtin.attention.triton import (  # noqa: E402
    TritonAttentionBackend,
    plan_kv_splits,
)
from inference_engine.engine.kv_cache import KVCachePool  # noqa: E402
from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec  # noqa: E402
from inference_engine.testing import run_under_triton_interpreter  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HEADS = 4

interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    # Only the wrapper and the GPU case skip there.
    assert "2 skipped" in stdout, stdout[-2000:]


# --------------------------------------------------------------------------- #
# Batches over a real pool
# --------------------------------------------------------------------------- #


@dataclass
class Batch:
    """One step's inputs, and each sequence's full K/V for checking the cache."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    metadata: AttentionMetadata
    pool: KVCachePool


def layer_cache(pool: KVCachePool) -> tuple[torch.Tensor, torch.Tensor]:
    # Layer 1 of 2: its views start mid-block and stride over layer 0's bytes.
    k_cache, v_cache = pool.layer_views(1)
    return k_cache, v_cache


def make_batch(shapes: list[tuple[int, int]], kv_heads: int, head_dim: int, block_size: int,
               cache_dtype: torch.dtype = torch.float32, num_padding: int = 0,
               seed: int = 0) -> Batch:
    """A step of ``(cached, new)`` token sequences (decodes first) over scattered blocks.

    The cached context is random and already in the cache (quantised like a write
    would); ``num_padding`` CUDA-graph padding rows (query 1, context 0, slot -1) follow.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = sum(blocks_per_seq) + 3
    spec = KVCacheSpec(2, kv_heads, head_dim, cache_dtype)
    pool = KVCachePool([spec, spec], block_size, num_blocks, torch.device("cpu"))
    k_cache, v_cache = layer_cache(pool)
    block_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(shapes) + num_padding, max(blocks_per_seq) + 1, dtype=torch.int64)
    slots, query_lens, seq_lens, keys, values = [], [], [], [], []
    for i, ((cached, new), nb) in enumerate(zip(shapes, blocks_per_seq, strict=True)):
        table = [block_ids.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(table)
        k = torch.randn(cached + new, kv_heads, head_dim, generator=gen)
        v = torch.randn(cached + new, kv_heads, head_dim, generator=gen)
        pos = torch.arange(cached + new)
        blocks, offsets = tables[i, pos // block_size], pos % block_size
        k_cache[blocks[:cached], offsets[:cached]] = quantize(k[:cached], cache_dtype, 1.0)
        v_cache[blocks[:cached], offsets[:cached]] = quantize(v[:cached], cache_dtype, 1.0)
        slots += (blocks[cached:] * block_size + offsets[cached:]).tolist()
        keys.append(k[cached:])
        values.append(v[cached:])
        query_lens.append(new)
        seq_lens.append(cached + new)
    query_lens += [1] * num_padding
    seq_lens += [0] * num_padding
    slots += [-1] * num_padding
    pad = torch.zeros(num_padding, kv_heads, head_dim)
    num_tokens = sum(query_lens)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(query_lens).cumsum(0)
    metadata = AttentionMetadata(
        num_tokens=num_tokens,
        num_decodes=sum(1 for n in query_lens if n == 1),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        block_size=block_size,
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        is_graph_step=num_padding > 0,
    )
    query = torch.randn(num_tokens, HEADS, head_dim, generator=gen)
    return Batch(query, torch.cat([*keys, pad]), torch.cat([*values, pad]), metadata, pool)


def copy_pool(pool: KVCachePool) -> KVCachePool:
    twin = KVCachePool(pool.specs, pool.block_size, pool.num_blocks, torch.device("cpu"))
    twin.storage.copy_(pool.storage)
    return twin


def reference_output(batch: Batch, backend: TritonAttentionBackend) -> torch.Tensor:
    """The reference's write on a copy of the pool, then its attention: ``[T, H * D]``."""
    pool = copy_pool(batch.pool)
    k_cache, v_cache = layer_cache(pool)
    md = batch.metadata
    write_kv_cache_reference(batch.key, batch.value, k_cache, v_cache, md.slot_mapping,
                             backend.k_scale, backend.v_scale)
    out = paged_attention_reference(
        batch.query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
        backend.scale, sliding_window=backend.sliding_window, sinks=backend.sinks,
        softcap=backend.softcap, k_scale=backend.k_scale, v_scale=backend.v_scale)
    return out.flatten(1)


def run_triton(batch: Batch, backend: TritonAttentionBackend) -> tuple[torch.Tensor, KVCachePool]:
    """The backend's forward on a copy of the pool; the output and the written pool."""
    pool = copy_pool(batch.pool)
    out = backend.forward(batch.query, batch.key, batch.value, layer_cache(pool), batch.metadata)
    return out, pool


def make_backend(kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 sinks: bool = False, softcap: float | None = None) -> TritonAttentionBackend:
    backend = TritonAttentionBackend(HEADS, head_dim, kv_heads, 1 / math.sqrt(head_dim),
                                     sliding_window, softcap=softcap)
    if sinks:
        backend.sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(7))
    return backend


def check_against_reference_and_sdpa(batch: Batch, backend: TritonAttentionBackend,
                                     with_sdpa: bool = True) -> None:
    """Output ~1e-5 of the reference (and torch_sdpa), and the pool as the reference wrote it."""
    got, pool = run_triton(batch, backend)
    expect = reference_output(batch, backend)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    if with_sdpa:
        sdpa = TorchSDPABackend(backend.num_heads, backend.head_dim, backend.num_kv_heads,
                                backend.scale, backend.sliding_window)
        sdpa.sinks = backend.sinks
        sdpa_pool = copy_pool(batch.pool)
        sdpa_out = sdpa.forward(batch.query, batch.key, batch.value, layer_cache(sdpa_pool),
                                batch.metadata)
        torch.testing.assert_close(got, sdpa_out, atol=1e-5, rtol=1e-5)
        assert torch.equal(pool.storage, sdpa_pool.storage)


# Two decodes, a chunk after cached context, a fresh prompt.
MIXED = [(9, 1), (2, 1), (13, 6), (0, 11)]


# --------------------------------------------------------------------------- #
# Kernel cases (TRITON_INTERPRET=1 child)
# --------------------------------------------------------------------------- #


@interp
@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # GQA ratios 1, 2, 4
@pytest.mark.parametrize("head_dim", [32, 24])  # 24: padded to 32 with masks
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_reference_and_sdpa(kv_heads, head_dim, block_size):
    batch = make_batch(MIXED, kv_heads, head_dim, block_size, seed=kv_heads + head_dim)
    check_against_reference_and_sdpa(batch, make_backend(kv_heads, head_dim))


@interp
@pytest.mark.parametrize(("kv_heads", "block_size", "window"), [(2, 4, 3), (1, 16, 5), (4, 4, 8)])
@pytest.mark.parametrize("sinks", [False, True])
def test_sliding_window_and_sinks_match_reference_and_sdpa(kv_heads, block_size, window, sinks):
    batch = make_batch(MIXED + [(21, 9)], kv_heads, 24, block_size, seed=window)
    check_against_reference_and_sdpa(batch, make_backend(kv_heads, 24, window, sinks))


@interp
@pytest.mark.parametrize("window", [None, 6])
def test_softcap_matches_reference(window):
    batch = make_batch(MIXED, 2, 32, 4, seed=3)
    batch.query *= 4  # scores well past the cap, where tanh saturates
    check_against_reference_and_sdpa(batch, make_backend(2, 32, window, True, softcap=2.5),
                                     with_sdpa=False)


@interp
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (None, True), (150, True)])
def test_split_kv_decode_of_long_contexts(window, sinks):
    """Few decodes of long contexts are split over their keys (two launches)."""
    shapes = [(900, 1), (260, 1), (555, 1)]
    assert plan_kv_splits(len(shapes), 2, 1, 901)[0] > 1
    batch = make_batch(shapes, 2, 32, 16, seed=11)
    check_against_reference_and_sdpa(batch, make_backend(2, 32, window, sinks))


@interp
@pytest.mark.parametrize("num_splits", [2, 5])
def test_explicit_splits_of_a_mixed_batch_match_reference(num_splits):
    """Any batch may be split; splits past a short sequence's keys see nothing."""
    from inference_engine.builtin.attention.triton_attention_kernel import paged_attention

    batch = make_batch(MIXED, 2, 24, 4, seed=num_splits)
    k_cache, v_cache = layer_cache(batch.pool)  # context only: the new keys are not written
    md = batch.metadata
    args = (batch.query, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3)
    options = {"sliding_window": 7, "sinks": torch.randn(HEADS)}
    got = paged_attention(*args, max_query_len=md.max_query_len, num_splits=num_splits,
                          keys_per_split=4, **options)
    torch.testing.assert_close(got, paged_attention_reference(*args, **options),
                               atol=1e-5, rtol=1e-5)


@interp
def test_padding_rows_write_nothing_and_output_zeros():
    """A graph step's padding rows (query 1, context 0, slot -1): zeros out, pool untouched."""
    batch = make_batch([(5, 1), (17, 1)], 2, 32, 4, num_padding=3, seed=4)
    backend = make_backend(2, 32, sinks=True)
    got, pool = run_triton(batch, backend)
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))
    torch.testing.assert_close(got, reference_output(batch, backend), atol=1e-5, rtol=1e-5)
    expect_pool = copy_pool(batch.pool)
    k_cache, v_cache = layer_cache(expect_pool)
    write_kv_cache_reference(batch.key, batch.value, k_cache, v_cache,
                             batch.metadata.slot_mapping)
    assert torch.equal(pool.storage, expect_pool.storage)


@interp
def test_forward_reads_nothing_back_to_the_host():
    """A graph step's forward under the host-sync guard, with the runner's bounds and
    with bounds left 0 (taken from the host lists)."""
    from inference_engine.testing_sync import no_host_sync

    batch = make_batch([(40, 1), (3, 1)], 2, 32, 4, num_padding=2, seed=9)
    backend = make_backend(2, 32, sinks=True)
    k_cache, v_cache = layer_cache(batch.pool)
    with no_host_sync(cuda_debug=False):
        backend.forward(batch.query, batch.key, batch.value, (k_cache, v_cache), batch.metadata)
        batch.metadata.max_query_len = batch.metadata.max_seq_len = 0
        backend.forward(batch.query, batch.key, batch.value, (k_cache, v_cache), batch.metadata)


@interp
def test_cache_write_is_bit_exact_against_indexing():
    """Into a strided fp32 view, shuffled slots, padding skipped, NaN and inf kept."""
    from inference_engine.builtin.attention.triton_attention_kernel import write_kv_cache

    spec = KVCacheSpec(2, 2, 24, torch.float32)
    pool = KVCachePool([spec, spec], 4, 12, torch.device("cpu"))
    k_cache, v_cache = layer_cache(pool)
    fused = torch.randn(7, 3 * 2 * 24)  # key and value are strided views into one row
    key = fused[:, : 2 * 24].view(7, 2, 24)
    value = fused[:, 2 * 2 * 24 :].view(7, 2, 24)
    key[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -1e-40])
    slots = torch.tensor([13, -1, 2, 45, 30, -1, 5])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expect_k[slots[keep] // 4, slots[keep] % 4] = key[keep]
    expect_v[slots[keep] // 4, slots[keep] % 4] = value[keep]
    write_kv_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expect_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expect_v, atol=0, rtol=0, equal_nan=True)
    # Layer 0's bytes around the view are untouched.
    assert torch.equal(pool.layer_views(0)[0], torch.zeros_like(pool.layer_views(0)[0]))


@interp
def test_fp8_cache_write_quantises_like_the_reference():
    """``clamp(x / scale)`` as float8 e4m3, saturating at 448.

    The interpreter's float8 cast rounds half away from zero and drops the carry out of
    the mantissa, so the inputs here are representable after scaling (power-of-two
    scales) plus out-of-range values; the GPU rounds to nearest even as torch does.
    """
    from inference_engine.builtin.attention.triton_attention_kernel import write_kv_cache

    spec = KVCacheSpec(2, 2, 32, torch.float8_e4m3fn)
    pool = KVCachePool([spec, spec], 4, 8, torch.device("cpu"))
    k_cache, v_cache = layer_cache(pool)
    gen = torch.Generator().manual_seed(8)
    exact = (torch.randn(6, 2, 32, generator=gen) * 30).to(torch.float8_e4m3fn).float()
    key, value = exact * 0.5, exact * 4.0
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 300.0, -250.0])  # past 448 * 0.5: saturate
    slots = torch.tensor([3, 9, -1, 20, 31, 14])
    write_kv_cache(key, value, k_cache, v_cache, slots, 0.5, 4.0)
    ref = copy_pool(pool)
    ref.storage.zero_()
    ref_k, ref_v = layer_cache(ref)
    write_kv_cache_reference(key, value, ref_k, ref_v, slots, 0.5, 4.0)
    assert torch.equal(pool.storage, ref.storage)
    assert k_cache[0, 3, 0, 0].float() == 448 and k_cache[0, 3, 0, 1].float() == -448


@interp
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float16])
def test_low_precision_cache_read_matches_reference(cache_dtype):
    """fp32 queries over an fp8 (scaled) or fp16 cache: the same cache values either way."""
    batch = make_batch(MIXED, 2, 32, 4, cache_dtype=cache_dtype, seed=6)
    if cache_dtype == torch.float8_e4m3fn:
        # Representable after scaling (see the write test), so both writes agree.
        batch.key = batch.key.to(torch.float8_e4m3fn).float() * 0.25
        batch.value = batch.value.to(torch.float8_e4m3fn).float() * 2.0
    backend = make_backend(2, 32, sinks=True)
    backend.k_scale, backend.v_scale = (0.25, 2.0) if cache_dtype == torch.float8_e4m3fn else (1, 1)
    got, _ = run_triton(batch, backend)
    torch.testing.assert_close(got, reference_output(batch, backend), atol=1e-5, rtol=1e-5)


@interp
def test_greedy_tokens_match_transformers(tmp_path):
    """A tiny Qwen3 through the engine on the CPU platform with the triton backend."""
    import transformers
    from inference_engine import SamplingParams
    from inference_engine.testing import cpu_llm, make_tiny_model, train_tiny_tokenizer
    from inference_engine.testing_parity import assert_greedy_matches, hf_greedy

    tokenizer = train_tiny_tokenizer()
    path = make_tiny_model(tmp_path, "qwen3", tokenizer=tokenizer)
    prompts = ["The quick brown fox", "Paged attention stores keys and values in fixed"]
    new_tokens = 8
    # Block 4 and an 8-token budget: chunked prefills share steps with decodes.
    llm = cpu_llm(path, dtype="float32", attention_backend="triton", block_size=4,
                  max_num_batched_tokens=8, kv_cache_memory=1 << 22)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    for ids, out, ref in zip(prompt_ids, outs, hf_greedy(model, prompt_ids, new_tokens),
                             strict=True):
        assert out.prompt_token_ids == ids
        assert_greedy_matches(model, ids, out.outputs[0].token_ids, ref)


# --------------------------------------------------------------------------- #
# On a GPU (compiled kernels, bf16, CUDA graphs)
# --------------------------------------------------------------------------- #


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_step_on_gpu_matches_reference_and_replays_in_a_cuda_graph():
    """Compiled kernels: a bf16 mixed batch (fp8 rounding is the GPU's own) and a padded
    decode step captured in a CUDA graph, replayed on new queries."""
    cuda = torch.device("cuda")

    def on_gpu(batch: Batch) -> Batch:
        pool = KVCachePool(batch.pool.specs, batch.pool.block_size, batch.pool.num_blocks, cuda)
        pool.storage.copy_(batch.pool.storage)
        md = batch.metadata
        gpu_md = dataclasses.replace(
            md, query_start_loc=md.query_start_loc.to(cuda), seq_lens=md.seq_lens.to(cuda),
            slot_mapping=md.slot_mapping.to(cuda), block_tables=md.block_tables.to(cuda))
        return Batch(*(x.to(cuda, torch.bfloat16) for x in (batch.query, batch.key, batch.value)),
                     gpu_md, pool)

    batch = make_batch(MIXED + [(70, 33)], 2, 80, 16, cache_dtype=torch.bfloat16, seed=1)
    batch.query, batch.key, batch.value = (x.bfloat16().float()
                                           for x in (batch.query, batch.key, batch.value))
    backend = make_backend(2, 80, sinks=True)
    expect = reference_output(batch, backend)
    backend.sinks = backend.sinks.to(cuda)
    gpu = on_gpu(batch)
    got = backend.forward(gpu.query, gpu.key, gpu.value, layer_cache(gpu.pool), gpu.metadata)
    torch.testing.assert_close(got.float().cpu(), expect, atol=3e-2, rtol=3e-2)

    gpu = on_gpu(make_batch([(50, 1), (300, 1), (7, 1)], 2, 80, 16, torch.bfloat16,
                            num_padding=5, seed=2))
    cache = layer_cache(gpu.pool)
    eager = backend.forward(gpu.query, gpu.key, gpu.value, cache, gpu.metadata)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(gpu.query, gpu.key, gpu.value, cache, gpu.metadata)
    graph.replay()
    assert torch.equal(out, eager) and not out[3:].any()
    gpu.query.mul_(0.5)
    graph.replay()
    assert torch.equal(out, backend.forward(gpu.query, gpu.key, gpu.value, cache, gpu.metadata))


# --------------------------------------------------------------------------- #
# Host-only (both processes)
# --------------------------------------------------------------------------- #


def test_splits_only_decode_only_steps_with_few_long_sequences():
    assert plan_kv_splits(4, 8, 7, 4096) == (1, 0)  # a prefill in the step
    assert plan_kv_splits(64, 8, 1, 4096) == (1, 0)  # enough programs already
    assert plan_kv_splits(2, 2, 1, 300) == (1, 0)  # too short to be worth a reduce
    num_splits, keys_per_split = plan_kv_splits(2, 2, 1, 4000)
    assert 1 < num_splits <= 32 and keys_per_split % 64 == 0
    assert num_splits * keys_per_split >= 4000


def test_declares_what_it_supports():
    assert TritonAttentionBackend.graph_safe and TritonAttentionBackend.supports_sinks
    assert all(TritonAttentionBackend.supports_head_size(d) for d in (24, 64, 80, 96, 128, 256))
    assert not TritonAttentionBackend.supports_head_size(512)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        assert TritonAttentionBackend.supports_kv_cache_dtype(dtype)
    assert not TritonAttentionBackend.supports_kv_cache_dtype(torch.int8)
    with pytest.raises(ValueError, match="KV cache"):
        make_backend(2, 32).prepare(torch.device("cpu"), torch.int8)
