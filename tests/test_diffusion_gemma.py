"""DiffusionGemma block diffusion against transformers' ``diffusion_gemma`` (CPU, float32).

References: transformers' decoder logits (teacher forcing over a cached prefix) and its
``generate`` under the deterministic recipe (pad start canvas, near-zero temperature,
no EOS) and, seeded, under random sampling (the global RNG drives transformers' draws;
our per-request generator makes the same draws in the same order).
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from inference_engine import SamplingParams
from inference_engine.sampling_params import RequestOutputKind
from inference_engine.testing import TEST_PLATFORM, ServerProcess, cpu_llm
from inference_engine.testing_diffusion import (
    DETERMINISTIC_RECIPE,
    hf_diffusion_generate,
    make_tiny_diffusion_gemma,
)

CANVAS = 8
# Different lengths, two of them past the sliding window (8).
PROMPTS = [list(range(5, 10)), list(range(20, 37)), [7, 8, 9, 100, 200, 300, 11, 12, 13, 14, 15]]
# Prompt + 3 blocks.
MAX_TOKENS = 3 * CANVAS
# Random sampling, few steps (the sampler's accept/renoise paths all run).
SAMPLED = {"max_denoising_steps": 6}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    return make_tiny_diffusion_gemma(tmp_path_factory.mktemp("diffusion_gemma"),
                                     canvas_length=CANVAS, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def hf_recipe(hf_model):
    """transformers' output for each prompt alone under the deterministic recipe."""
    return [hf_diffusion_generate(hf_model, p, MAX_TOKENS, DETERMINISTIC_RECIPE) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(model_dir):
    return cpu_llm(model_dir, max_model_len=256)


def recipe_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                          extra_args=dict(DETERMINISTIC_RECIPE), **kw)


def test_denoise_logits_match_transformers_over_a_cached_prefix(hf_model, llm):
    """One decoder pass (self-conditioning on) over a 13-token prefix, past the sliding
    window: our logits are transformers'."""
    from inference_engine.engine.model_runner import StepBatch
    from inference_engine.engine.scheduler import ScheduledRequest
    from transformers import DynamicCache

    engine = llm.engine
    prompt = list(range(40, 53))
    torch.manual_seed(0)
    canvas = torch.randint(0, hf_model.config.text_config.vocab_size, (1, CANVAS))
    previous = torch.randn(1, CANVAS, hf_model.config.text_config.vocab_size) * 3
    with torch.no_grad():
        cache = DynamicCache(config=hf_model.config.get_text_config(decoder=True))
        ref = hf_model(input_ids=torch.tensor([prompt]), cache=cache, decoder_input_ids=canvas,
                       self_conditioning_logits=previous).logits[0]
    # Our side: the engine encodes the prompt into its paged cache, then one denoise pass.
    engine.add_request({"prompt_token_ids": prompt}, recipe_params(), request_id="probe")
    request = engine.scheduler.requests["probe"]
    while request.num_computed_tokens < len(prompt):
        out = engine.scheduler.schedule()
        engine.runner.execute_batch(StepBatch.from_scheduler(out))
        engine.scheduler.update_after_step(out)
    slot = ScheduledRequest(request, CANVAS, False, is_denoise=True,
                            block_ids=engine.blocks.req_blocks["probe"])
    stepper = engine.diffusion
    model = engine.model
    with torch.inference_mode():
        soft = model.soft_embeddings(previous)
        ours = model.denoise(canvas, soft, torch.arange(len(prompt), len(prompt) + CANVAS),
                             stepper._metadata([slot]))[0]
    engine.abort_request("probe")
    assert (ours - ref).abs().max().item() < 1e-4


def test_deterministic_recipe_matches_generate_for_prompts_run_together(llm, hf_recipe):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], recipe_params())
    assert [o.outputs[0].token_ids for o in outs] == hf_recipe
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_requests_at_different_phases_match_running_alone(llm, hf_recipe):
    """Requests join while others denoise: a step holds ENCODE chunks and DENOISE slots
    together, and each request still gets its lone output."""
    engine = llm.engine
    mixed_steps = 0
    original = engine.diffusion.run

    def spy(scheduled):
        nonlocal mixed_steps
        mixed_steps += 1 if spy.encoding else 0
        return original(scheduled)

    spy.encoding = False
    engine.diffusion.run = spy
    results: dict[str, list[int]] = {}
    try:
        pending = list(enumerate(PROMPTS))
        step = 0
        while pending or engine.has_unfinished_requests():
            if pending and step % 3 == 0:
                i, prompt = pending.pop(0)
                engine.add_request({"prompt_token_ids": prompt}, recipe_params(),
                                   request_id=f"r{i}")
            spy.encoding = any(r.num_computed_tokens < r.num_tokens
                               for r in engine.scheduler.running + list(engine.scheduler.waiting))
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output.outputs[0].token_ids
            step += 1
    finally:
        engine.diffusion.run = original
    assert [results[f"r{i}"] for i in range(len(PROMPTS))] == hf_recipe
    assert mixed_steps > 0


def test_seeded_sampling_matches_generate_and_any_batch_composition(llm, hf_model):
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=2 * CANVAS, ignore_eos=True, seed=3,
                            extra_args=dict(SAMPLED))
    alone = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    assert alone == hf_diffusion_generate(hf_model, prompt, 2 * CANVAS, SAMPLED, seed=3)
    others = [SamplingParams(max_tokens=CANVAS * (i + 1), ignore_eos=True, seed=100 + i,
                             extra_args=dict(SAMPLED)) for i in range(2)]
    batch = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": prompt},
                          {"prompt_token_ids": PROMPTS[2]}], [others[0], params, others[1]])
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(max_tokens=CANVAS, ignore_eos=True, extra_args=dict(SAMPLED))
    again = llm.generate([{"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": prompt}],
                         [unseeded, params])
    assert again[1].outputs[0].token_ids == alone


def test_committed_blocks_stream_one_block_at_a_time(llm):
    engine = llm.engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]},
                       recipe_params(output_kind=RequestOutputKind.DELTA), request_id="stream")
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [len(o.outputs[0].token_ids) for o in engine.step() if o.outputs[0].token_ids]
    assert deltas == [CANVAS] * (MAX_TOKENS // CANVAS)


def test_settings_come_from_the_generation_config_and_extra_args(llm, model_dir):
    from inference_engine.diffusion import DiffusionSettings
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    config = DiffusionGemmaGenerationConfig(
        max_denoising_steps=12, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.3),
        t_min=0.1, t_max=0.5, stability_threshold=2, confidence_threshold=0.01)
    config.save_pretrained(model_dir / "genconf")
    saved = json.loads((model_dir / "genconf" / "generation_config.json").read_text())
    settings = DiffusionSettings.from_generation_config(saved)
    assert (settings.max_denoising_steps, settings.entropy_bound, settings.t_min, settings.t_max,
            settings.stability_threshold, settings.confidence_threshold) == (
        12, 0.3, 0.1, 0.5, 2, 0.01)
    assert settings.with_overrides({"start_canvas": "pad", "t_max": 0.9}).t_max == 0.9
    state = llm.engine.diffusion.new_state(SamplingParams(extra_args={"max_denoising_steps": 3}))
    assert state.settings.max_denoising_steps == 3
    # The engine reads the checkpoint's generation_config.json.
    copy = model_dir.parent / "with_generation_config"
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("genconf"))
    config.save_pretrained(copy)
    assert cpu_llm(copy, max_model_len=64).engine.diffusion.defaults == settings


@pytest.mark.parametrize(("params", "named"), [
    (SamplingParams(extra_args={"steps": 3}), "'steps'"),
    (SamplingParams(extra_args={"t_min": 0.5, "t_max": 0.5}), "t_max"),
    (SamplingParams(extra_args={"start_canvas": "mask"}), "start_canvas"),
    (SamplingParams(logprobs=1), "logprobs"),
    (SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
    (SamplingParams(temperature=0.0), "temperature"),
    (SamplingParams(top_k=5), "top_k"),
    (SamplingParams(min_p=0.1), "min_p"),
])
def test_bad_requests_are_refused_by_name(llm, params, named):
    with pytest.raises(ValueError, match=named):
        llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, params)


def test_server_serves_completions_chat_and_streams(model_dir, llm):
    recipe = dict(DETERMINISTIC_RECIPE)
    prompt = "The quick brown fox"
    expected = llm.generate([prompt], recipe_params())[0].outputs[0].text
    server = ServerProcess(model_dir, "--max-model-len", "256", platform=TEST_PLATFORM)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **recipe}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
            chat = {"messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 2 * CANVAS, "ignore_eos": True, **recipe}
            r = http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            whole = r.json()["choices"][0]["message"]["content"]
            streamed = []
            with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        streamed.append(delta.get("content") or "")
            assert "".join(streamed) == whole
            image = {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}
            r = http.post("/v1/chat/completions", json=image)
            assert r.status_code == 400 and "image_url" in r.text
            for field, value in (("temperature", 0.7), ("top_k", 5), ("top_p", 0.9)):
                r = http.post("/v1/completions", json={**body, field: value})
                assert r.status_code == 400 and field in r.json()["error"]["message"]
            r = http.post("/v1/completions", json={**body, "max_denoising_steps": 0})
            assert r.status_code == 400 and "max_denoising_steps" in r.text
            r = http.post("/v1/completions", json={**body, "denoising_steps": 4})
            assert r.status_code == 400 and "denoising_steps" in r.text
    finally:
        server.stop()


def test_ar_and_diffusion_engines_stepped_together_match_alone(model_dir, hf_recipe,
                                                               tiny_model_dirs):
    """An engine holds one model, so the AR/diffusion mix is two engines stepped in turn
    in one process (the scheduler-level mix in one budget is core's
    test_diffusion_scheduling): each gets its lone output. The diffusion engine runs with
    async scheduling on, which must not change its tokens."""
    ar_llm = cpu_llm(tiny_model_dirs["qwen3"], max_model_len=256)
    diffusion_llm = cpu_llm(model_dir, max_model_len=256, async_scheduling=True)
    prompt = [5, 6, 7, 8, 9]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ar_alone = ar_llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
    ar, dg = ar_llm.engine, diffusion_llm.engine
    ar.add_request({"prompt_token_ids": prompt}, greedy, request_id="ar")
    for i, p in enumerate(PROMPTS):
        dg.add_request({"prompt_token_ids": p}, recipe_params(), request_id=f"d{i}")
    results = {}
    while ar.has_unfinished_requests() or dg.has_unfinished_requests():
        for engine in (ar, dg):
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output.outputs[0].token_ids
    assert results["ar"] == ar_alone
    assert [results[f"d{i}"] for i in range(len(PROMPTS))] == hf_recipe
    with pytest.raises(ValueError, match="max_denoising_steps"):
        ar.add_request({"prompt_token_ids": prompt},
                       SamplingParams(extra_args={"max_denoising_steps": 4}))


def test_preempted_requests_recompute_their_prefix_and_resume(model_dir, hf_recipe):
    """A 12-block pool (4 tokens each) cannot hold the three requests at full length: the
    newest is preempted (its prefix recomputed, its block's denoising resumed) and every
    output still equals transformers'."""
    bytes_per_token = 2 * 2 * 16 * 4 + 2 * 1 * 32 * 4  # sliding K/V + full-layer K/V, fp32
    small = cpu_llm(model_dir, max_model_len=64, block_size=4, max_num_batched_tokens=16,
                    kv_cache_memory=13 * 4 * bytes_per_token)
    outs = small.generate([{"prompt_token_ids": p} for p in PROMPTS], recipe_params())
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_recipe
