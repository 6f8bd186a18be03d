"""The bf16 GEMV kernel against float64 matmuls; a bf16 model through it against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from inference_engine import SamplingParams
from inference_engine.builtin.platforms import cpu as cpu_platform
from inference_engine.layers.cpu_gemv import (
    GEMV_MAX_ROWS,
    NATIVE_BF16_GEMV_MAX_ROWS,
    bf16_gemv_weight,
    gemv_kernel,
    gemv_max_rows,
    is_packed,
    small_batch_linear,
    unpack_bf16,
)
from inference_engine.testing import cpu_llm, make_tiny_model, train_tiny_tokenizer
from inference_engine.testing_parity import assert_greedy_matches

HAS_SIMD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")

needs_kernel = pytest.mark.skipif(not HAS_SIMD,
                                  reason="the bf16 GEMV kernel is AVX-512 or AVX2 only")


def _error_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The classic float32 dot-product bound: (K + 2) * eps * sum |x_k w_k| (+ |bias|)."""
    k = x.shape[1]
    mag = x.abs().double() @ w.abs().double().t()
    if bias is not None:
        mag = mag + bias.abs().double()
    return (k + 2) * torch.finfo(torch.float32).eps * mag + 1e-30


@needs_kernel
def test_kernel_builds_on_avx2_and_avx512():
    assert gemv_kernel() is not None, "the bf16 GEMV kernel failed to build (see the log)"


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, GEMV_MAX_ROWS])
@pytest.mark.parametrize("n,k", [(64, 512), (13, 40), (515, 96), (7, 1536), (1, 17), (48, 34),
                                 (1040, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64(rows, n, k, with_bias):
    """Row-major copies (shapes the packing does not take) and packed ones alike."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    gemv_weight = bf16_gemv_weight(weight)
    assert gemv_weight is not None and gemv_weight.dtype == torch.bfloat16
    assert is_packed(gemv_weight) == (n % 16 == 0 and k % 2 == 0)
    assert torch.equal(unpack_bf16(gemv_weight).float(), weight)
    module = gemv_kernel()
    ours = (module.gemv_packed if is_packed(gemv_weight) else module.gemv)(x, gemv_weight, bias)
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert ours.shape == (rows, n) and ours.dtype == torch.float32
    assert ((ours.double() - ref).abs() <= _error_bound(x, weight, bias)).all()


@needs_kernel
def test_column_major_weight_and_many_rows_use_the_same_values():
    """The copy holds the values whatever the float32 strides; past the row limit F.linear runs."""
    weight = torch.randn(48, 64).to(torch.bfloat16).float()
    column_major = weight.t().contiguous().t()
    gemv_weight = bf16_gemv_weight(column_major)
    assert gemv_weight is not None and gemv_weight.is_contiguous()
    assert torch.equal(unpack_bf16(gemv_weight).float(), weight)
    x = torch.randn(GEMV_MAX_ROWS + 5, 64)
    assert torch.equal(small_batch_linear(x, column_major, gemv_weight), F.linear(x, column_major))


@needs_kernel
@pytest.mark.parametrize("native", [False, True])
def test_row_limit_follows_the_cpus_gemm(monkeypatch, native):
    """Up to the limit the kernel runs; past it MKL's float32 GEMM unless bf16 GEMMs are allowed."""
    monkeypatch.setattr(cpu_platform, "has_native_bf16", lambda: native)
    limit = NATIVE_BF16_GEMV_MAX_ROWS if native else GEMV_MAX_ROWS
    assert gemv_max_rows() == limit
    weight = torch.randn(48, 96).to(torch.bfloat16).float()
    gemv_weight = bf16_gemv_weight(weight)
    x = torch.randn(limit, 96)
    assert torch.equal(small_batch_linear(x, weight, gemv_weight, bf16_gemm=True),
                       gemv_kernel().gemv_packed(x, gemv_weight, None))
    x = torch.randn(limit + 1, 96)
    assert torch.equal(small_batch_linear(x, weight, gemv_weight), F.linear(x, weight))


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_past_the_row_limit_rounds_like_a_bf16_model(monkeypatch, with_bias):
    """Activations rounded to bf16, float32 accumulation, the product rounded to bf16 (2^-8)."""
    monkeypatch.setattr(cpu_platform, "has_native_bf16", lambda: True)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(70, 256, generator=gen).to(torch.bfloat16).float()
    x = torch.randn(GEMV_MAX_ROWS + 3, 256, generator=gen)
    bias = torch.randn(70, generator=gen) if with_bias else None
    ours = small_batch_linear(x, weight, bf16_gemv_weight(weight), bias, bf16_gemm=True)
    x16 = x.to(torch.bfloat16).double()
    ref = x16 @ weight.double().t()
    bound = 2.0 ** -8 * ref.abs() + _error_bound(x16.float(), weight, None)
    if bias is not None:
        ref = ref + bias.double()
    assert ours.dtype == torch.float32
    assert ((ours.double() - ref).abs() <= bound + 1e-6).all()


def test_no_copy_when_it_would_not_be_exact():
    assert bf16_gemv_weight(torch.randn(32, 64)) is None  # float32 values that bf16 cannot hold
    assert bf16_gemv_weight(torch.randn(32, 64).to(torch.bfloat16)) is None  # not a float32 weight
    assert bf16_gemv_weight(torch.randn(64).to(torch.bfloat16).float()) is None  # not a matrix


def test_disabled_kernels_fall_back(monkeypatch):
    import inference_engine.layers.cpu_gemv as cpu_gemv

    monkeypatch.setattr(cpu_gemv, "gemv_kernel", lambda: None)
    monkeypatch.setattr(cpu_platform, "has_native_bf16", lambda: False)
    weight = torch.randn(8, 16).to(torch.bfloat16).float()
    assert cpu_gemv.bf16_gemv_weight(weight) is None
    x = torch.randn(2, 16)
    assert torch.equal(cpu_gemv.small_batch_linear(x, weight, None), F.linear(x, weight))
    # A CPU with a bf16 GEMM still keeps the copy for it, and few rows use F.linear.
    monkeypatch.setattr(cpu_platform, "has_native_bf16", lambda: True)
    copy = cpu_gemv.bf16_gemv_weight(weight)
    assert copy is not None
    assert not cpu_gemv.is_packed(copy)  # no kernel: the oneDNN path's row-major copy
    assert torch.equal(cpu_gemv.small_batch_linear(x, weight, copy, bf16_gemm=True),
                       F.linear(x.to(torch.bfloat16), copy).float())


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A bfloat16 checkpoint, and transformers running its (exactly widened) float32 weights."""
    path = make_tiny_model(tmp_path_factory.mktemp("bf16"), "qwen3", dtype=torch.bfloat16,
                           tokenizer=train_tiny_tokenizer())
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    return path, reference


@needs_kernel
def test_bf16_checkpoint_decodes_through_the_kernel_like_transformers(bf16_model):
    path, reference = bf16_model
    llm = cpu_llm(str(path), dtype="float32", show_progress=False, kv_cache_memory=1 << 24)
    copies = [m for m in llm.engine.model.modules() if getattr(m, "gemv_weight", None) is not None]
    assert len(copies) >= 2 * 4 + 1, "qkv, o, gate_up, down per layer and the LM head"
    prompts = ["The quick brown fox", "1 2 3", "Paged attention stores keys and values in blocks"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for out in llm.generate(prompts, params):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = reference.generate(ids, do_sample=False, max_new_tokens=24,
                                     attention_mask=torch.ones_like(ids))
        assert_greedy_matches(reference, out.prompt_token_ids, out.outputs[0].token_ids,
                              ref[0, ids.shape[1]:].tolist())


@needs_kernel
def test_decode_logprobs_through_the_kernel_match_transformers(bf16_model):
    """Teacher-forced: the engine's log-probs of its own greedy tokens equal transformers'."""
    path, reference = bf16_model
    llm = cpu_llm(str(path), dtype="float32", show_progress=False, kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    out = llm.generate(["héllo wörld, the quick brown fox"], params)[0]
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0].double()
    ref = torch.log_softmax(logits, dim=-1)
    start = len(out.prompt_token_ids) - 1
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs,
                                           strict=True)):
        ours = entry[token].logprob
        assert abs(ours - ref[start + i, token].item()) < 1e-4


@needs_kernel
def test_bf16_gemm_only_when_bfloat16_was_asked_for(bf16_model):
    path, _ = bf16_model
    for dtype, expected in (("float32", False), ("bfloat16", True), ("auto", True)):
        llm = cpu_llm(str(path), dtype=dtype, show_progress=False, kv_cache_memory=1 << 24)
        modules = llm.engine.model.modules()
        layers = [m for m in modules if getattr(m, "gemv_weight", None) is not None]
        assert layers and all(getattr(m, "bf16_gemm", False) == expected for m in layers), dtype


@needs_kernel
@pytest.mark.parametrize("runner", ["pool", "aten"])
def test_kernel_on_either_thread_pool(runner):
    """The same values whether the spinning pool or ATen's threads run the tasks."""
    from inference_engine import cpu_thread_pool

    module = gemv_kernel()
    if runner == "pool" and cpu_thread_pool.thread_pool() is None:
        pytest.skip("the pool did not build")
    with cpu_thread_pool.kernel_runner(module, use_pool=runner == "pool"):
        gen = torch.Generator().manual_seed(3)
        weight = torch.randn(1040, 512, generator=gen).to(torch.bfloat16).float()
        gemv_weight = bf16_gemv_weight(weight)
        row_major = unpack_bf16(gemv_weight).contiguous()
        for rows in (1, 3, 8, 33):
            x = torch.randn(rows, 512, generator=gen)
            ours = module.gemv_packed(x, gemv_weight, None)
            assert ((ours.double() - x.double() @ weight.double().t()).abs()
                    <= _error_bound(x, weight, None)).all()
            ours = module.gemv(x, row_major, None)
            ref = x.double() @ weight.double().t()
            assert ((ours.double() - ref).abs() <= _error_bound(x, weight, None)).all()


needs_dpbf16 = pytest.mark.skipif(
    not HAS_SIMD or gemv_kernel() is None or not gemv_kernel().has_dpbf16(),
    reason="the bf16 dot-product GEMM needs AVX512-BF16")


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 7, 13, 64, 67, 700])
@pytest.mark.parametrize("n,k", [(64, 512), (16, 2), (1040, 96), (48, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_dpbf16_gemm_matches_float64_on_bf16_activations(rows, n, k, with_bias):
    """Activations rounded to bf16 (nearest even); the sums are float32, not rounded after."""
    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = gemv_kernel().pack_bf16(weight)
    assert torch.equal(unpack_bf16(packed), weight)
    ours = gemv_kernel().gemm_packed(x, packed, bias)
    x16 = x.to(torch.bfloat16)
    ref = F.linear(x16.double(), weight.double(), None if bias is None else bias.double())
    assert ours.shape == (rows, n) and ours.dtype == torch.float32
    assert ((ours.double() - ref).abs() <= _error_bound(x16.float(), weight.float(), bias)).all()


@needs_dpbf16
def test_batches_past_the_gemv_limit_use_the_packed_gemm():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16).float()
    copy = bf16_gemv_weight(weight)
    assert is_packed(copy)
    for rows in (gemv_max_rows() + 1, 300, 2100):
        x = torch.randn(rows, 64, generator=gen)
        got = small_batch_linear(x, weight, copy, bf16_gemm=True)
        assert torch.equal(got, gemv_kernel().gemm_packed(x, copy, None))
    # A shape the packing does not take keeps a row-major copy and oneDNN (rounded to bf16).
    odd = torch.randn(90, 64, generator=gen).to(torch.bfloat16).float()
    row_major = bf16_gemv_weight(odd)
    assert not is_packed(row_major)
    x = torch.randn(40, 64, generator=gen)
    assert torch.equal(small_batch_linear(x, odd, row_major, bf16_gemm=True),
                       F.linear(x.to(torch.bfloat16), row_major).float())


def test_kv_cache_dtype_follows_the_checkpoint(bf16_model):
    """auto: a bf16 checkpoint run in float32 caches bf16; float32 asked: float32."""
    path, _ = bf16_model
    cases = (("auto", "auto", torch.bfloat16), ("bfloat16", "auto", torch.bfloat16),
             ("float32", "auto", torch.float32), ("bfloat16", "float32", torch.float32),
             ("float32", "bfloat16", torch.bfloat16))
    for dtype, kv, expected in cases:
        llm = cpu_llm(str(path), dtype=dtype, kv_cache_dtype=kv, show_progress=False,
                  kv_cache_memory=1 << 24)
        specs = llm.engine.runner.pool.specs
        assert specs and all(spec.dtype == expected for spec in specs), (dtype, kv)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        cpu_llm(str(path), kv_cache_dtype="fp4", show_progress=False)


def _rounding_cache_update(self, key_states, value_states, *args, **kwargs):
    """transformers' DynamicLayer.update storing K/V rounded to bf16, as our bf16 cache
    does; attention (prefill included) reads the rounded values, as ours does."""
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
    self.keys = torch.cat([self.keys, key_states.bfloat16().float()], dim=-2)
    self.values = torch.cat([self.values, value_states.bfloat16().float()], dim=-2)
    return self.keys, self.values


@pytest.fixture(scope="module")
def bf16_model_head64(tmp_path_factory):
    """As ``bf16_model`` with 64-dim heads: the CPU attention kernels' fast paths."""
    path = make_tiny_model(tmp_path_factory.mktemp("bf16h64"), "qwen3", dtype=torch.bfloat16,
                           tokenizer=train_tiny_tokenizer(), head_dim=64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    return path, reference


@pytest.mark.parametrize("model", ["bf16_model", "bf16_model_head64"])
def test_bf16_kv_cache_matches_transformers_with_a_rounding_cache(model, monkeypatch, request):
    """float32 compute with a bf16 KV cache: greedy tokens and their log-probs equal
    transformers whose cache rounds K/V to bf16 the same way."""
    import transformers.cache_utils as cache_utils

    path, reference = request.getfixturevalue(model)
    llm = cpu_llm(str(path), dtype="float32", kv_cache_dtype="bfloat16", show_progress=False,
              kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    prompts = ["The quick brown fox", "Paged attention stores keys and values in blocks"]
    outs = llm.generate(prompts, params)
    monkeypatch.setattr(cache_utils.DynamicLayer, "update", _rounding_cache_update)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = reference.generate(ids, do_sample=False, max_new_tokens=20,
                                     attention_mask=torch.ones_like(ids), output_scores=True,
                                     return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref_tokens
        for step, (token, entry) in enumerate(zip(ref_tokens, out.outputs[0].logprobs,
                                                  strict=True)):
            ref_lp = torch.log_softmax(ref.scores[step][0].double(), -1)[token].item()
            # A K/V value within a float32 ulp of a bf16 rounding midpoint may round the
            # other way in transformers (a 2^-8 step): ~1e-4 here. The same engine with a
            # float32 cache is 6e-4 (16-dim heads) to 3e-3 (64) from it: 3e-4 tells them apart.
            assert abs(entry[token].logprob - ref_lp) < 3e-4
