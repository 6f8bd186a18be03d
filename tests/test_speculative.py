"""Speculative decoding end to end: every proposer is lossless against the same engine
without speculation (greedy token for token; seeded sampling token for token, since draw
j of a seeded request depends only on its seed and draw number), also with chunked
prefill, preemption, stop strings, n > 1 and logprobs; bad configs are refused by name.

The target is the committed demo model (trained, float32), on the CPU platform.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from inference_engine import SamplingParams
from inference_engine.registry import UnknownNameError
from inference_engine.testing import cpu_llm, make_tiny_model

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo-qwen3-tiny"
SMALL_KV = 1 << 24
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7,",
    "def f(x):\n    return x\ndef f(x):\n    return",
    "The cat sat on the mat. The cat sat on the",
    "Hello! How are you?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _llm(**kwargs):
    return cpu_llm(DEMO, dtype="float32", kv_cache_memory=SMALL_KV, block_size=4, **kwargs)


def _ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain():
    return _llm()


@pytest.fixture(scope="module")
def ngram():
    return _llm(speculative_config=NGRAM)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A random drafter with the demo model's vocabulary (low acceptance, still lossless)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    return make_tiny_model(tmp_path_factory.mktemp("drafter"), "qwen3", tokenizer=tokenizer,
                           vocab_size=2064, num_hidden_layers=1)


@pytest.fixture(scope="module")
def plain_greedy(plain):
    return _ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_ngram_greedy_equals_plain_and_accepts_on_repetitive_text(ngram, plain_greedy):
    before = dict(ngram.engine.stats())
    assert _ids(ngram.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    stats = ngram.engine.stats()
    drafts = stats["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = (stats["spec_decode_num_accepted_tokens"]
                - before["spec_decode_num_accepted_tokens"])
    assert drafts > 0
    # Repetitive prompts: more than two tokens per verifying step.
    assert 1 + accepted / drafts > 2
    assert len(stats["spec_decode_num_accepted_tokens_per_pos"]) == K


def test_seeded_sampling_equals_plain(plain, ngram):
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=24,
                             ignore_eos=True, repetition_penalty=1.1) for s in range(4)]
    assert (_ids(ngram.generate(PROMPTS, params, use_tqdm=False))
            == _ids(plain.generate(PROMPTS, params, use_tqdm=False)))


def test_stop_strings_n2_and_logprobs_match_plain(plain, ngram):
    base = plain.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = base[10:13]
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16, ignore_eos=True,
                            logprobs=2, stop=[stop])
    want = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    got = ngram.generate(PROMPTS[:2], params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert (gc.token_ids, gc.text, gc.finish_reason, gc.stop_reason) == (
                wc.token_ids, wc.text, wc.finish_reason, wc.stop_reason)
            assert len(gc.logprobs) == len(gc.token_ids)
            for wl, gl in zip(wc.logprobs, gc.logprobs, strict=True):
                assert wl.keys() == gl.keys()
                for token in wl:
                    assert abs(wl[token].logprob - gl[token].logprob) < 1e-4


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "dflash"])
def test_lossless_with_chunked_prefill_and_preemption(method, plain_greedy, drafter_dir,
                                                      tmp_path):
    from inference_engine.speculative.testing import make_dflash_drafter, make_eagle3_drafter

    model = {"draft_model": lambda: drafter_dir,
             "eagle3": lambda: make_eagle3_drafter(tmp_path / "e", DEMO),
             "dflash": lambda: make_dflash_drafter(tmp_path / "d", DEMO, block_size=4,
                                                   target_layer_ids=(1, 3)),
             "ngram": lambda: None}[method]()
    config = dict(NGRAM) if method == "ngram" else {
        "method": method, "model": str(model), "num_speculative_tokens": 3}
    # 16-token steps chunk every prompt; 28 blocks of 4 tokens cannot hold 4 sequences of
    # ~50 tokens (plus lookahead), so requests are preempted and recomputed.
    llm = cpu_llm(DEMO, dtype="float32", block_size=4, max_num_batched_tokens=16,
                  kv_cache_memory=28 * 12352, speculative_config=config)
    assert llm.engine.blocks.num_blocks <= 30
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["kv_cache_usage"] == 0.0


def test_draft_model_lossless_and_self_drafting_accepts_nearly_all(plain_greedy):
    # The target drafting for itself: greedy drafts are the target's own argmax, so almost
    # every draft is accepted; this checks the drafter's own paged KV end to end.
    llm = _llm(speculative_config={"method": "draft_model", "model": str(DEMO),
                                   "num_speculative_tokens": 3})
    assert llm.engine.scheduler.num_lookahead_slots == 3
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    stats = llm.engine.stats()
    assert stats["spec_decode_mean_acceptance_length"] > 3.5
    # Sampled requests stay lossless with greedy drafts.
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)
              for s in range(4)]
    plain_llm = _llm()
    assert (_ids(llm.generate(PROMPTS, params, use_tqdm=False))
            == _ids(plain_llm.generate(PROMPTS, params, use_tqdm=False)))


def test_probabilistic_draft_model_is_lossless_and_batch_independent(plain_greedy):
    # draft_sample_method probabilistic: drafts drawn with the request's parameters and
    # their q verified by min(1, p/q). The target drafting for itself has q = p (up to
    # float rounding), so nearly every sampled draft is accepted, which a point-mass
    # draft (accepted with p(d)) would not be at temperature 1.
    config = {"method": "draft_model", "model": str(DEMO), "num_speculative_tokens": 3,
              "draft_sample_method": "probabilistic"}
    llm = _llm(speculative_config=config)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=16,
                             ignore_eos=True) for s in range(4)]
    before = dict(llm.engine.stats())
    together = _ids(llm.generate(PROMPTS, params, use_tqdm=False))
    stats = llm.engine.stats()
    drafts = stats["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = (stats["spec_decode_num_accepted_tokens"]
                - before["spec_decode_num_accepted_tokens"])
    assert drafts > 0 and 1 + accepted / drafts > 3.5
    # Seeded requests: the same tokens whatever else is in the batch.
    alone = [_ids(llm.generate([p], [sp], use_tqdm=False))[0]
             for p, sp in zip(PROMPTS, params, strict=True)]
    assert together == alone
    assert _ids(llm.generate(PROMPTS[::-1], params[::-1], use_tqdm=False)) == together[::-1]
    with pytest.raises(ValueError, match="draft_sample_method.*ngram"):
        _llm(speculative_config={**NGRAM, "draft_sample_method": "probabilistic"})


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_probabilistic_hidden_state_drafters_are_lossless_and_batch_independent(
        method, plain_greedy, tmp_path):
    from inference_engine.speculative.testing import make_dflash_drafter, make_eagle3_drafter

    model = (make_eagle3_drafter(tmp_path / "e", DEMO) if method == "eagle3" else
             make_dflash_drafter(tmp_path / "d", DEMO, block_size=4, target_layer_ids=(1, 3)))
    llm = _llm(speculative_config={"method": method, "model": str(model),
                                   "num_speculative_tokens": 3,
                                   "draft_sample_method": "probabilistic"})
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(3)]
    together = _ids(llm.generate(PROMPTS[:3], params, use_tqdm=False))
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
    assert [_ids(llm.generate([p], [sp], use_tqdm=False))[0]
            for p, sp in zip(PROMPTS[:3], params, strict=True)] == together


def test_abort_mid_speculation_frees_everything(ngram):
    engine = ngram.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200,
                                                        ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.usage == 0.0


def test_bad_configs_are_refused_by_name(tiny_model_dirs):
    model = tiny_model_dirs["qwen3"]
    with pytest.raises(ValueError, match="prompt_lookupp_max"):
        cpu_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                           "prompt_lookupp_max": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        cpu_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        cpu_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                           "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(UnknownNameError, match="medusa"):
        cpu_llm(model, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'model' is required"):
        cpu_llm(model, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocabulary"):
        cpu_llm(model, speculative_config={"method": "draft_model", "model": str(DEMO),
                                           "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async_scheduling and speculative_config"):
        cpu_llm(model, kv_cache_memory=SMALL_KV, async_scheduling=True,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_structured_outputs_with_speculation_equal_plain_decoding(plain, ngram):
    """Each verified position is masked by the grammar state after the drafts before it:
    greedy constrained outputs equal plain decoding's, token for token, and follow the
    constraint (drafts the grammar refuses are rejected, never emitted)."""
    import json

    import jsonschema
    from inference_engine.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "days": {"type": "array", "maxItems": 3,
                                      "items": {"enum": ["mon", "tue", "wed"]}}},
              "required": ["city", "days"]}
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=c) for c in (
        StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        StructuredOutputsParams(regex=r"(ab|cd){2,6}"))]
    prompts = [PROMPTS[0], "Answer yes or no: is the sky blue?", PROMPTS[1]]
    want = plain.generate(prompts, params)
    metrics = ngram.engine.spec.metrics
    drafted, accepted = metrics.num_draft_tokens, metrics.num_accepted_tokens
    got = ngram.generate(prompts, params)
    assert _ids(got) == _ids(want)
    drafted, accepted = metrics.num_draft_tokens - drafted, metrics.num_accepted_tokens - accepted
    assert drafted > accepted > 0  # drafts were verified under the grammar, some refused
    jsonschema.validate(json.loads(got[0].outputs[0].text), schema)
    assert got[1].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"(ab|cd){2,6}", got[2].outputs[0].text)


def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "inference_engine.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_generate_and_bench_take_speculative_config(plain):
    import json

    config = json.dumps(NGRAM)
    result = _cli("generate", "--model", str(DEMO), "--prompt", PROMPTS[0], "--max-tokens",
                  "12", "--ignore-eos", "--platform", "cpu", "--kv-cache-memory",
                  str(SMALL_KV), "--speculative-config", config, "--json")
    assert result.returncode == 0, result.stderr
    want = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    assert json.loads(result.stdout)["token_ids"] == want[0].outputs[0].token_ids
    result = _cli("bench", "--model", str(DEMO), "--num-prompts", "2", "--input-len", "8",
                  "--output-len", "8", "--platform", "cpu", "--kv-cache-memory",
                  str(SMALL_KV), "--speculative-config", config, "--json")
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["spec_decode"]
    assert {"mean_acceptance_length", "acceptance_rate_per_pos", "num_draft_tokens"} <= set(spec)
    bad = _cli("generate", "--model", str(DEMO), "--prompt", "x", "--platform", "cpu",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokenz": 2}')
    assert bad.returncode == 2 and "num_speculative_tokenz" in bad.stderr
    bad = _cli("serve", str(DEMO), "--platform", "cpu", "--speculative-config", "{ngram")
    assert bad.returncode == 2 and "--speculative-config is not valid JSON" in bad.stderr


def test_metrics_expose_speculative_counters(ngram):
    from inference_engine.entrypoints.openai.metrics import ServerMetrics

    ngram.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    text = ServerMetrics("demo", vllm_names=True).render(ngram.engine.stats()).decode()
    stats = ngram.engine.stats()
    assert (f'inference_engine:spec_decode_num_accepted_tokens_total{{model_name="demo"}} '
            f'{float(stats["spec_decode_num_accepted_tokens"])}') in text
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="3"}' in text
    assert "vllm:spec_decode_num_drafts_total" in text
    assert "inference_engine:spec_decode_mean_acceptance_length" in text


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    from inference_engine.speculative.testing import make_eagle3_drafter

    return make_eagle3_drafter(tmp_path_factory.mktemp("eagle3"), DEMO, draft_vocab_size=512)


def test_eagle3_lossless_and_drafts_match_a_full_sequence_reference(plain, plain_greedy,
                                                                      eagle3_dir):
    """Greedy and seeded outputs equal plain decoding; and every first draft equals the
    drafter run over the whole sequence at once on transformers' hidden states of the
    target (no cache, no bookkeeping): the per-position features and the paged K/V are
    right, whatever the acceptance of a random drafter."""
    import torch
    import transformers
    from inference_engine.speculative.eagle3 import Eagle3Proposer
    from inference_engine.speculative.paged_drafter_cache import PagedDrafterCache

    llm = cpu_llm(DEMO, dtype="float32", kv_cache_memory=SMALL_KV, block_size=4,
                  max_num_batched_tokens=16,
                  speculative_config={"method": "eagle3", "model": str(eagle3_dir),
                                      "num_speculative_tokens": 3})
    proposer = llm.engine.spec.proposer
    seen: list[tuple[list[int], int]] = []
    original = Eagle3Proposer.propose

    def recording(self, requests):
        proposal = original(self, requests)
        for r, drafts in zip(requests, proposal.token_ids, strict=True):
            if drafts:
                seen.append((list(r.token_ids), drafts[0]))
        return proposal

    proposer.propose = recording.__get__(proposer)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    assert seen
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(2)]
    assert (_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False))
            == _ids(plain.generate(PROMPTS[:2], params, use_tqdm=False)))
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    drafter = proposer.drafter
    ids = proposer.tap.layer_ids
    for tokens, first_draft in seen[:: max(1, len(seen) // 12)]:
        with torch.no_grad():
            states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            aux = torch.cat([states[i][0] for i in ids], dim=-1)[:-1]  # positions 0..L-2
            n = len(tokens) - 1
            cache = PagedDrafterCache(drafter.num_kv_heads, drafter.head_dim, 4,
                                      torch.float32, torch.device("cpu"))
            cache.allocate(-(-n // 4) + 1)
            logits, _ = drafter(torch.tensor(tokens[1:]), aux, torch.arange(n), cache,
                                [list(range(-(-n // 4)))], [n])
        assert int(proposer._to_target(logits[-1].argmax())) == first_draft


def test_dflash_lossless_and_blocks_match_a_cacheless_reference(plain, plain_greedy, tmp_path):
    """Greedy and seeded outputs equal plain decoding; every drafted block equals z-lab's
    formula computed without a cache: context K/V from hidden_norm(fc(target layer
    outputs)) of transformers' hidden states, the block attending to the context and,
    non-causally, to itself."""
    import torch
    import transformers
    from inference_engine.speculative.dflash import DFlashProposer
    from inference_engine.speculative.paged_drafter_cache import rms_norm, rope
    from inference_engine.speculative.testing import make_dflash_drafter

    drafter_dir = make_dflash_drafter(tmp_path / "dflash", DEMO, block_size=4,
                                      target_layer_ids=(0, 3), num_layers=2)
    llm = cpu_llm(DEMO, dtype="float32", kv_cache_memory=SMALL_KV, block_size=4,
                  max_num_batched_tokens=16,
                  speculative_config={"method": "dflash", "model": str(drafter_dir),
                                      "num_speculative_tokens": 3})
    proposer = llm.engine.spec.proposer
    assert llm.engine.scheduler.num_lookahead_slots == 4
    seen: list[tuple[list[int], list[int]]] = []
    original = DFlashProposer.propose

    def recording(self, requests):
        proposal = original(self, requests)
        for r, drafts in zip(requests, proposal.token_ids, strict=True):
            if len(drafts) == 3:
                seen.append((list(r.token_ids), drafts))
        return proposal

    proposer.propose = recording.__get__(proposer)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    assert seen
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(2)]
    assert (_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False))
            == _ids(plain.generate(PROMPTS[:2], params, use_tqdm=False)))

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    d = proposer.drafter
    theta, eps = d.rope_theta, d.eps
    for tokens, drafts in seen[:: max(1, len(seen) // 10)]:
        n = len(tokens) - 1  # context positions 0..n-1; the block starts at n
        with torch.no_grad():
            states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            ctx = torch.cat([states[1][0], states[4][0]], dim=-1)[:n]
            ctx = rms_norm(d.fc(ctx), d.hidden_norm, eps)
            block = torch.tensor([tokens[-1]] + [proposer.mask_token_id] * 3)
            hidden = hf.model.embed_tokens(block)
            ctx_pos, block_pos = torch.arange(n), torch.arange(n, n + 4)
            for layer in d.layers:
                x = rms_norm(hidden, layer.input_layernorm, eps)

                def kv(src, pos, layer=layer):
                    k = layer.k_proj(src).view(len(src), d.num_kv_heads, d.head_dim)
                    k = rope(rms_norm(k, layer.k_norm, eps), pos, theta)
                    return k, layer.v_proj(src).view(len(src), d.num_kv_heads, d.head_dim)

                kc, vc = kv(ctx, ctx_pos)
                kb, vb = kv(x, block_pos)
                q = layer.q_proj(x).view(4, d.num_heads, d.head_dim)
                q = rope(rms_norm(q, layer.q_norm, eps), block_pos, theta)
                group = d.num_heads // d.num_kv_heads
                k = torch.cat([kc, kb]).repeat_interleave(group, 1).transpose(0, 1)
                v = torch.cat([vc, vb]).repeat_interleave(group, 1).transpose(0, 1)
                attn = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v)
                hidden = hidden + layer.o_proj(attn.transpose(0, 1).reshape(4, -1))
                x = rms_norm(hidden, layer.post_attention_layernorm, eps)
                hidden = hidden + layer.down_proj(
                    torch.nn.functional.silu(layer.gate_proj(x)) * layer.up_proj(x))
            logits = hf.lm_head(rms_norm(hidden, d.norm, eps))
        assert logits[1:].argmax(-1).tolist() == drafts


def test_lora_requests_are_lossless_with_speculation(tmp_path):
    """LoRA and speculation together: the verify forward applies each request's adapter to
    all its 1 + k tokens (the n-gram drafter needs none); outputs equal LoRA without it."""
    from inference_engine import LoRARequest
    from inference_engine.lora.testing import make_peft_adapter

    adapter = make_peft_adapter(DEMO, tmp_path / "lora", seed=1, r=4,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    lora = LoRARequest("a", 1, str(adapter))
    prompts = PROMPTS[:2]
    kwargs = dict(dtype="float32", kv_cache_memory=SMALL_KV, block_size=4, enable_lora=True,
                  max_lora_rank=8)
    want = cpu_llm(DEMO, **kwargs).generate(prompts, GREEDY, use_tqdm=False,
                                            lora_request=[lora, None])
    llm = cpu_llm(DEMO, speculative_config=NGRAM, **kwargs)
    got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora, None])
    assert _ids(got) == _ids(want)
    assert llm.engine.stats()["spec_decode_num_drafts"] > 0


def test_serve_with_speculative_config_answers_as_plain_and_reports_metrics(plain):
    import json

    import httpx
    from inference_engine.testing import TEST_PLATFORM, ServerProcess

    server = ServerProcess(DEMO, "--speculative-config", json.dumps(NGRAM),
                           platform=TEST_PLATFORM)
    try:
        body = {"model": str(DEMO), "prompt": PROMPTS[0], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        want = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16,
                                                         ignore_eos=True), use_tqdm=False)
        assert reply["choices"][0]["text"] == want[0].outputs[0].text
        text = httpx.get(server.url + "/metrics", timeout=30).text
        drafts = [line for line in text.splitlines()
                  if line.startswith("inference_engine:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
    finally:
        assert server.stop() == 0, server.log()
