"""The C++ decode step against the layer loop it replaces (bit for bit) and transformers."""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.layers import cpu_decode_step
from inference_engine.layers.cpu_decode_step import CpuDecodeStep, decode_step_blocker
from inference_engine.layers.cpu_gemv import gemv_kernel
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_parity import assert_greedy_matches

HAS_SIMD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")

pytestmark = pytest.mark.skipif(not HAS_SIMD or gemv_kernel() is None,
                                reason="the packed bf16 GEMV kernel needs AVX-512 or AVX2 and a build")

PROMPTS = [list(range(5, 5 + n)) for n in (7, 19, 40)]


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def bf16_model(request, tmp_path_factory):
    """A bfloat16 checkpoint (qwen2: q/k/v biases; qwen3: per-head q/k norms)."""
    path = tmp_path_factory.mktemp(f"step-{request.param}")
    return make_tiny_model(path, request.param, dtype=torch.bfloat16, num_hidden_layers=3,
                           sliding_window=None)


def _outputs(llm, params: SamplingParams) -> list[tuple[list[int], list]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def test_step_equals_the_layer_loop_bit_for_bit(bf16_model, monkeypatch):
    """Same tokens and the same log-probabilities, float for float, over mixed prefill/decode
    steps and pure-decode steps of 1-3 sequences, with the step running every decode."""
    llm = cpu_llm(bf16_model, dtype="bfloat16", enable_prefix_caching=False,
                  max_num_batched_tokens=32)
    model = llm.engine.model.model
    step = model.decode_step
    assert step is not None, decode_step_blocker(model)
    calls = []
    run = CpuDecodeStep.run
    monkeypatch.setattr(CpuDecodeStep, "run",
                        lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    fused = _outputs(llm, params)
    assert len(calls) >= 23 and max(calls) == len(PROMPTS)
    model.decode_step = None
    assert _outputs(llm, params) == fused


def test_step_greedy_matches_transformers(tmp_path):
    """A bf16 checkpoint computed in float32 (a float32 cache) through the step, against
    transformers on the exactly widened weights."""
    path = make_tiny_model(tmp_path, "qwen3", dtype=torch.bfloat16, num_hidden_layers=3)
    llm = cpu_llm(path, dtype="float32", enable_prefix_caching=False)
    assert llm.engine.model.model.decode_step is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS:
        ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                              min_new_tokens=20, pad_token_id=0)[0, len(prompt):].tolist()
        assert_greedy_matches(hf, prompt, ours.outputs[0].token_ids, ref)


def test_models_the_step_cannot_run_keep_the_layer_loop(tmp_path):
    """Float32 values that bf16 cannot hold (no packed copy) and a float8 cache: a reason each."""
    f32 = make_tiny_model(tmp_path / "f32", "qwen3")
    model = cpu_llm(f32, enable_prefix_caching=False).engine.model.model
    assert model.decode_step is None
    assert "no packed bf16 weight" in decode_step_blocker(model)
    bf16 = make_tiny_model(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    model = cpu_llm(bf16, dtype="bfloat16", kv_cache_dtype="fp8").engine.model.model
    assert model.decode_step is None
    assert "KV cache" in decode_step_blocker(model) or "backend" in decode_step_blocker(model)


def test_step_is_dropped_with_the_cache(tmp_path):
    path = make_tiny_model(tmp_path, "llama", dtype=torch.bfloat16)
    llm = cpu_llm(path, dtype="bfloat16")
    runner = llm.engine.runner
    assert llm.engine.model.model.decode_step is not None
    runner.release_kv_cache()
    assert llm.engine.model.model.decode_step is None
    assert "KV cache" in cpu_decode_step.decode_step_blocker(llm.engine.model.model)
