"""Greedy tokens and logprobs of the whole engine against transformers (fp32).

Where a greedy token differs, it must be at a genuine near-tie of the
reference's logits (top-2 within 1e-4); anything else fails.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.testing import cpu_llm
from inference_engine.testing_parity import assert_greedy_matches

SMALL_KV = 1 << 24  # 16 MiB: plenty for these tests, quick to allocate

NEW_TOKENS = 32
PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed size blocks. Continuous batching mixes",
    "héllo wörld",
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "def add(a, b):",
    "1 2 3",
]


@pytest.fixture(scope="module")
def references(tiny_model_dirs, tiny_tokenizer):
    """arch -> (hf model, [greedy continuation per prompt], tokenizer).

    Prompts are tokenized by ``AutoTokenizer`` of the saved folder, as a
    transformers user (and the engine) would load it.
    """
    refs = {}
    for arch, path in tiny_model_dirs.items():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model, conts = _greedy_reference(path, tokenizer)
        refs[arch] = (model, conts, tokenizer)
    return refs


def _greedy_reference(path, tokenizer):
    """transformers' model at ``path`` and its greedy continuation of every prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Like ignore_eos: no EOS handling at all (min_new_tokens would mask EOS logits).
    model.generation_config.eos_token_id = None
    conts = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                                 attention_mask=torch.ones_like(ids))
        conts.append(out[0, ids.shape[1]:].tolist())
    return model, conts


ENGINE_SETUPS = {
    "default": {},
    "torch_sdpa": {"attention_backend": "torch_sdpa"},
    "block4": {"block_size": 4},
    "chunked": {"max_num_batched_tokens": 8, "block_size": 4},
    "no_prefix_cache": {"enable_prefix_caching": False, "block_size": 4},
    "preempt": {"block_size": 4, "kv_cache_memory": 28 * 4 * 2 * 2 * 2 * 16 * 4},
    "preempt_sdpa": {"block_size": 4, "kv_cache_memory": 28 * 4 * 2 * 2 * 2 * 16 * 4,
                     "attention_backend": "torch_sdpa", "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_parity_qwen3(setup, tiny_model_dirs, tiny_tokenizer, references):
    llm = cpu_llm(str(tiny_model_dirs["qwen3"]), dtype="float32", show_progress=False,
              **{"kv_cache_memory": SMALL_KV, **ENGINE_SETUPS[setup]})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # Run twice: the second pass hits the prefix cache where it is on.
    for _ in range(2):
        outs = llm.generate(PROMPTS, params)
        model, conts, _ = references["qwen3"]
        for prompt, out, ref in zip(PROMPTS, outs, conts, strict=True):
            assert out.prompt_token_ids == references["qwen3"][2].encode(prompt)
            assert len(out.outputs[0].token_ids) == NEW_TOKENS
            assert out.outputs[0].finish_reason == "length"
            assert_greedy_matches(model, out.prompt_token_ids, out.outputs[0].token_ids, ref)
    if setup.startswith("preempt"):
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    if setup == "default":
        assert llm.engine.blocks.stats.hit_tokens > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_other_archs(arch, tiny_model_dirs, references):
    llm = cpu_llm(str(tiny_model_dirs[arch]), dtype="float32", show_progress=False,
              kv_cache_memory=SMALL_KV, block_size=4,
              max_num_batched_tokens=12)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    model, conts, _ = references[arch]
    for out, ref in zip(outs, conts, strict=True):
        assert_greedy_matches(model, out.prompt_token_ids, out.outputs[0].token_ids, ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prompt_logprobs_match_reference(arch, tiny_model_dirs, tiny_tokenizer, references):
    """prompt_logprobs are log-softmax of the model's logits: compare to transformers."""
    llm = cpu_llm(str(tiny_model_dirs[arch]), dtype="float32", show_progress=False,
              kv_cache_memory=SMALL_KV, block_size=4,
              max_num_batched_tokens=8)
    prompt = PROMPTS[1]
    ids = references[arch][2].encode(prompt)
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=3,
                                              temperature=0.0))[0]
    model = references[arch][0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos][ids[pos]].logprob
        assert abs(got - float(ref[pos - 1, ids[pos]])) < 1e-4
    # Generated-token logprobs: the top-3 of the last position.
    top = ref[-1].topk(3)
    got = out.outputs[0].logprobs[0]
    for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert abs(got[token].logprob - value) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["paged", "torch_sdpa"])
def test_last_position_logits_match_reference(arch, backend, tiny_model_dirs, references):
    """Raw float32 logits of one mixed prefill batch against transformers, 1e-4 max abs."""
    llm = cpu_llm(str(tiny_model_dirs[arch]), dtype="float32", show_progress=False,
              kv_cache_memory=SMALL_KV, block_size=4,
              attention_backend=backend)
    engine = llm.engine
    model, _, tokenizer = references[arch]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=f"p{i}")
    step = engine.scheduler.schedule()
    blocks = [engine.blocks.req_blocks[s.request.request_id] for s in step.scheduled]
    logits = engine.runner.execute(step, blocks)
    for row, index in enumerate(logits.sample_rows):
        ids = step.scheduled[index].request.prompt_token_ids
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1].float()
        assert (logits.sample_logits[row] - ref).abs().max() < 1e-4
    engine.abort_request([f"p{i}" for i in range(len(PROMPTS))])


def test_context_beyond_max_position_embeddings(tmp_path, tiny_tokenizer):
    """``--max-model-len`` above the config's max_position_embeddings: positions past it
    are rotated as transformers rotates them (default rope has no limit)."""
    from inference_engine.testing import make_tiny_model

    path = make_tiny_model(tmp_path / "short", "llama", tokenizer=tiny_tokenizer,
                           max_position_embeddings=16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompt = tiny_tokenizer.encode(PROMPTS[1])[:12]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=36,
                             attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    llm = cpu_llm(str(path), dtype="float32", max_model_len=64, kv_cache_memory=SMALL_KV,
              show_progress=False)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=36, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert_greedy_matches(model, prompt, list(out), ref)


@pytest.fixture(scope="module")
def head64(tmp_path_factory, tiny_tokenizer):
    """A qwen3 with 64-dim heads, the size the CPU attention kernels are built for (the
    other tiny models have 16-dim heads, which take the kernels' plain loops / torch)."""
    from inference_engine.testing import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("head64"), "qwen3", tokenizer=tiny_tokenizer,
                           head_dim=64)
    model, conts = _greedy_reference(path, transformers.AutoTokenizer.from_pretrained(path))
    return path, model, conts


@pytest.mark.parametrize("setup", ["default", "block4", "chunked", "preempt"])
def test_greedy_parity_through_the_cpu_attention_kernels(setup, head64):
    """Prefill (fresh and continued chunks) and decode through the C++ kernels."""
    path, model, conts = head64
    extra = dict(ENGINE_SETUPS[setup])
    if setup == "preempt":
        extra["kv_cache_memory"] = 28 * 4 * 2 * 2 * 2 * 64 * 4
    llm = cpu_llm(str(path), dtype="float32", show_progress=False,
              **{"kv_cache_memory": SMALL_KV, **extra})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(PROMPTS, params)
        for out, ref in zip(outs, conts, strict=True):
            assert_greedy_matches(model, out.prompt_token_ids, out.outputs[0].token_ids, ref)
    if setup == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"


def test_prefill_logits_through_the_cpu_attention_kernels(head64):
    """Chunked prefill (8-token steps, 16-token blocks) logprobs against transformers."""
    path, model, _ = head64
    llm = cpu_llm(str(path), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV,
              max_num_batched_tokens=8)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode(PROMPTS[1] + " " + PROMPTS[3])
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                 temperature=0.0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos][ids[pos]].logprob
        assert abs(got - float(ref[pos - 1, ids[pos]])) < 1e-4
