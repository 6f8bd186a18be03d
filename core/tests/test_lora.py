"""LoRA against transformers + peft: one adapter, and a batch mixing two adapters and the base.

peft builds each adapter on the transformers model with random, non-zero A and B
(``init_lora_weights=False``) and saves it in its own format; the reference is
the same transformers model with the adapter applied by peft.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_engine import LoRARequest, SamplingParams
from inference_engine.lora.testing import ALL_TARGETS, make_peft_adapter, peft_reference
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_parity import assert_greedy_matches, hf_greedy

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", arch="qwen3")
    plain = make_peft_adapter(base, root / "plain", seed=1, r=8, lora_alpha=16,
                              target_modules=ALL_TARGETS)
    rs = make_peft_adapter(base, root / "rslora", seed=2, r=4, lora_alpha=8, use_rslora=True,
                           target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    return {"base": base, "plain": plain, "rslora": rs}


@pytest.fixture(scope="module")
def llm(lora_setup: dict[str, Path]):
    return cpu_llm(lora_setup["base"], enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_num_seqs=8)


PROMPTS = [[5, 17, 42, 9, 77, 3], [100, 12, 8, 250, 31], [7, 7, 64, 19, 200, 41, 2]]


def greedy(llm, prompts, lora):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("which", ["plain", "rslora"])
def test_one_adapter_matches_peft(llm, lora_setup, which: str) -> None:
    request = LoRARequest(which, 1 if which == "plain" else 2, str(lora_setup[which]))
    ours = greedy(llm, PROMPTS, request)
    reference = peft_reference(lora_setup["base"], lora_setup[which])
    for prompt, got, ref in zip(PROMPTS, ours, hf_greedy(reference, PROMPTS, NEW_TOKENS),
                                strict=True):
        assert_greedy_matches(reference, prompt, got, ref)


def test_mixed_batch_gives_each_its_own_tokens(llm, lora_setup) -> None:
    plain = LoRARequest("plain", 1, str(lora_setup["plain"]))
    rs = LoRARequest("rslora", 2, str(lora_setup["rslora"]))
    references = {"plain": peft_reference(lora_setup["base"], lora_setup["plain"]),
                  "base": peft_reference(lora_setup["base"], None),
                  "rslora": peft_reference(lora_setup["base"], lora_setup["rslora"])}
    # The same prompt under each adapter and the base model, plus a longer prompt, all in
    # one batch (prefill and decode steps mix the three).
    rows = [(PROMPTS[0], plain, "plain"), (PROMPTS[0], None, "base"), (PROMPTS[0], rs, "rslora"),
            (PROMPTS[2], plain, "plain")]
    ours = greedy(llm, [p for p, _, _ in rows], [lora for _, lora, _ in rows])
    expected = [hf_greedy(references[name], [p], NEW_TOKENS)[0] for p, _, name in rows]
    assert len({tuple(t) for t in expected[:3]}) == 3, "the adapters must change the output"
    for (prompt, _, name), got, ref in zip(rows, ours, expected, strict=True):
        assert_greedy_matches(references[name], prompt, got, ref)


def test_more_adapters_than_slots_take_turns(lora_setup) -> None:
    """One device slot, two adapters and the base model in one generate: the scheduler runs
    one adapter at a time and the slot is swapped from host memory; each matches peft."""
    llm = cpu_llm(lora_setup["base"], enable_lora=True, max_loras=1, max_lora_rank=8)
    plain = LoRARequest("plain", 1, str(lora_setup["plain"]))
    rs = LoRARequest("rslora", 2, str(lora_setup["rslora"]))
    rows = [(PROMPTS[0], plain, "plain"), (PROMPTS[1], rs, "rslora"), (PROMPTS[2], None, None),
            (PROMPTS[1], plain, "plain")]
    ours = greedy(llm, [p for p, _, _ in rows], [lora for _, lora, _ in rows])
    references = {name: peft_reference(lora_setup["base"], lora_setup[name] if name else None)
                  for name in ("plain", "rslora", None)}
    for (prompt, _, name), got in zip(rows, ours, strict=True):
        ref = hf_greedy(references[name], [prompt], NEW_TOKENS)[0]
        assert_greedy_matches(references[name], prompt, got, ref)


def test_prefix_cache_is_per_adapter(llm, lora_setup) -> None:
    """K/V cached by the base model is not reused under an adapter (nor the other way);
    the same adapter reuses its own."""
    prompt = [(7 * i + 3) % 300 + 2 for i in range(40)]  # more than two 16-token blocks
    plain = LoRARequest("plain", 1, str(lora_setup["plain"]))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params)
    first = llm.generate({"prompt_token_ids": prompt}, params, lora_request=plain)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params, lora_request=plain)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32
    reference = peft_reference(lora_setup["base"], lora_setup["plain"])
    ref = hf_greedy(reference, [prompt], NEW_TOKENS)[0]
    for out in (first, again):
        assert_greedy_matches(reference, prompt, out.outputs[0].token_ids, ref)


def test_lora_request_needs_enable_lora(lora_setup) -> None:
    llm = cpu_llm(lora_setup["base"])
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("plain", 1,
                                                            str(lora_setup["plain"])))


def test_lora_request_per_prompt_count_is_checked(llm, lora_setup) -> None:
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([PROMPTS[0]], lora_request=[None, None])


def test_lora_keeps_the_cpu_decode_step_off(tmp_path) -> None:
    """A bf16 checkpoint that the whole-step C++ decode would run: with LoRA on, the step is
    not bound (the delta is added layer by layer every step) and greedy output still equals
    transformers + peft."""
    from inference_engine.layers.cpu_decode_step import decode_step_blocker
    from inference_engine.layers.cpu_gemv import gemv_kernel

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or gemv_kernel() is None:
        pytest.skip("the C++ decode step needs AVX-512 or AVX2 and the CPU kernels")
    base = make_tiny_model(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    adapter = make_peft_adapter(base, tmp_path / "adapter", seed=5, r=4, lora_alpha=8,
                                target_modules=ALL_TARGETS)
    plain = cpu_llm(base, dtype="float32").engine.model.model
    assert plain.decode_step is not None
    llm = cpu_llm(base, dtype="float32", enable_lora=True, max_lora_rank=4)
    assert llm.engine.model.model.decode_step is None
    assert "LoRA" in decode_step_blocker(llm.engine.model.model)
    ours = greedy(llm, PROMPTS, LoRARequest("a", 1, str(adapter)))
    reference = peft_reference(base, adapter)
    for prompt, got, ref in zip(PROMPTS, ours, hf_greedy(reference, PROMPTS, NEW_TOKENS),
                                strict=True):
        assert_greedy_matches(reference, prompt, got, ref)
