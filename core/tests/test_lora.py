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
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_parity import assert_greedy_matches, hf_greedy

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 12


def make_adapter(base: Path, out: Path, seed: int, **lora: object) -> Path:
    """Save a random peft LoRA adapter for the model at ``base`` under ``out``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():  # peft's random init of B is small: make the adapter decisive
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(out)
    return out


def peft_reference(base: Path, adapter: Path | None) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", arch="qwen3")
    plain = make_adapter(base, root / "plain", seed=1, r=8, lora_alpha=16,
                         target_modules=ALL_TARGETS)
    rs = make_adapter(base, root / "rslora", seed=2, r=4, lora_alpha=8, use_rslora=True,
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
