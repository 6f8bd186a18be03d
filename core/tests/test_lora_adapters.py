"""Bad LoRA adapters fail their own request with a message naming the problem; the
grouped shrink/expand reference equals the per-token formula."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from inference_engine import LoRARequest, SamplingParams
from inference_engine.lora.grouped_matmul import lora_delta_reference, make_segments
from inference_engine.lora.testing import ALL_TARGETS, make_peft_adapter, peft_reference
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_parity import assert_greedy_matches, hf_greedy
from safetensors.torch import load_file, save_file

pytest.importorskip("peft")

PROMPT = [5, 17, 42, 9, 77, 3]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_bad")
    base = make_tiny_model(root / "base", arch="llama")
    other = make_tiny_model(root / "other", arch="llama", hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1)
    return {
        "root": root, "base": base,
        "good": make_peft_adapter(base, root / "good", seed=1, r=4, lora_alpha=8,
                                  target_modules=ALL_TARGETS),
        "rank16": make_peft_adapter(base, root / "rank16", seed=2, r=16, lora_alpha=16,
                                    target_modules=["q_proj"]),
        "other_base": make_peft_adapter(other, root / "other_base", seed=3, r=4, lora_alpha=8,
                                        target_modules=["q_proj", "v_proj"]),
        "lm_head": make_peft_adapter(base, root / "lm_head", seed=4, r=4, lora_alpha=8,
                                     target_modules=["q_proj", "lm_head"]),
    }


@pytest.fixture(scope="module")
def llm(setup):
    return cpu_llm(setup["base"], enable_lora=True, max_loras=2, max_lora_rank=8)


def without_tensors(setup: dict[str, Path], name: str, fragments: list[str]) -> Path:
    """A copy of the good adapter without the tensors whose names contain a fragment."""
    out = setup["root"] / name
    if not out.exists():
        shutil.copytree(setup["good"], out)
        tensors = load_file(out / "adapter_model.safetensors")
        save_file({k: v for k, v in tensors.items() if not any(f in k for f in fragments)},
                  out / "adapter_model.safetensors")
    return out


def with_config(setup: dict[str, Path], name: str, **changes: object) -> Path:
    out = setup["root"] / name
    if not out.exists():
        shutil.copytree(setup["good"], out)
        config = json.loads((out / "adapter_config.json").read_text())
        config.update(changes)
        (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case, pattern", [
    ("rank16", r"rank 16 is above max_lora_rank \(8\)"),
    ("other_base", r"q_proj has lora_A \(4, 32\).*expects \(4, 64\)"),
    ("lm_head", r"unknown target modules \['lm_head'\]"),
    ("missing_B", r"missing tensor .*lora_B\.weight"),
    ("missing_layer", r"missing tensors for 2 targeted modules"),
    ("dora", r"DoRA is not supported"),
    ("not_a_dir", r"is not a directory"),
])
def test_bad_adapter_is_a_clear_error(llm, setup, case: str, pattern: str) -> None:
    paths = {
        "missing_B": lambda: without_tensors(setup, "missing_B",
                                             [".layers.0.self_attn.k_proj.lora_B."]),
        # Both halves of two targeted modules gone.
        "missing_layer": lambda: without_tensors(
            setup, "missing_layer", [".layers.1.self_attn.o_proj.", ".layers.0.mlp.up_proj."]),
        "dora": lambda: with_config(setup, "dora", use_dora=True),
        "not_a_dir": lambda: setup["root"] / "nowhere",
    }
    path = paths[case]() if case in paths else setup[case]
    with pytest.raises(ValueError, match=pattern):
        llm.generate([PROMPT], lora_request=LoRARequest(case, 50, str(path)))


def test_bad_adapter_does_not_disturb_running_requests(llm, setup) -> None:
    """A request with a good adapter is running when one with a bad adapter arrives: the bad
    one is refused at once, the good one finishes as peft says it should."""
    engine = llm.engine
    good = LoRARequest("good", 1, str(setup["good"]))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request({"prompt_token_ids": PROMPT}, params, request_id="good", lora_request=good)
    engine.step()
    with pytest.raises(ValueError, match="rank 16"):
        engine.add_request({"prompt_token_ids": PROMPT}, params, request_id="bad",
                           lora_request=LoRARequest("rank16", 2, str(setup["rank16"])))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    reference = peft_reference(setup["base"], setup["good"])
    ref = hf_greedy(reference, [PROMPT], 10)[0]
    assert_greedy_matches(reference, PROMPT, finished[0].outputs[0].token_ids, ref)


@pytest.mark.parametrize("slot_of", [
    [2, 2, -1, 0, 0, 0, -1, 2, 1, 1, 0],  # three slots and tokens with no adapter
    [1] * 6,  # one adapter for every token (no reordering)
    [3, -1, 1, 1, 3],  # slots that are not consecutive (gathered, not a view)
])
def test_grouped_shrink_expand_equals_per_token_formula(slot_of: list[int]) -> None:
    """Each token with an adapter gets ``B_s A_s x`` of its own slot, the others nothing."""
    torch.manual_seed(0)
    slots, rank, k, n = 4, 6, 24, 40
    a = torch.randn(slots, rank, k, dtype=torch.float64)
    b = torch.randn(slots, n, rank, dtype=torch.float64)
    x = torch.randn(len(slot_of), k, dtype=torch.float64)
    base = torch.randn(len(slot_of), n, dtype=torch.float64)
    seg = make_segments(slot_of, torch.device("cpu"), torch.float64)
    out = lora_delta_reference(x, a, b, seg, base.clone())
    expected = base.clone()
    for t, s in enumerate(slot_of):
        if s >= 0:
            expected[t] += b[s] @ (a[s] @ x[t])
    torch.testing.assert_close(out, expected)
    assert make_segments([-1, -1], torch.device("cpu"), torch.float64) is None



def test_host_cache_and_slots_are_least_recently_used(setup) -> None:
    """``max_cpu_loras`` adapters stay read (oldest dropped first); a slot goes to the least
    recently used adapter the step does not need; a step never needs more than the slots."""
    llm = cpu_llm(setup["base"], enable_lora=True, max_loras=1, max_cpu_loras=2,
                  max_lora_rank=8)
    manager = llm.engine.lora
    requests = [LoRARequest(f"a{i}", i + 1, str(setup["good"])) for i in range(3)]
    adapters = [manager.load(r) for r in requests]
    assert [r.lora_name for r in manager.loaded()] == ["a1", "a2"]
    assert manager.load(requests[1]) is adapters[1]  # held: not read again
    manager.prepare_step([adapters[0], None], [3, 1])
    assert manager.slot_contents() == [adapters[0]]
    manager.prepare_step([adapters[2]], [1])
    assert manager.slot_contents() == [adapters[2]]
    with pytest.raises(RuntimeError, match="max_loras"):
        manager.prepare_step([adapters[0], adapters[1]], [1, 1])


def test_unloading_a_running_adapter_lets_its_request_finish(llm, setup) -> None:
    engine = llm.engine
    good = LoRARequest("good", 7, str(setup["good"]))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request({"prompt_token_ids": PROMPT}, params, request_id="unloaded",
                       lora_request=good)
    engine.step()
    assert engine.remove_lora(7)
    assert all(r.lora_int_id != 7 for r in engine.list_loras())
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    reference = peft_reference(setup["base"], setup["good"])
    ref = hf_greedy(reference, [PROMPT], 10)[0]
    assert_greedy_matches(reference, PROMPT, finished[0].outputs[0].token_ids, ref)


def test_a_request_waiting_for_a_slot_does_not_hold_back_others(setup) -> None:
    """One slot, busy with adapter 1: a request for adapter 2 waits, the base-model request
    behind it runs at once; the waiting one runs when adapter 1's request is done."""
    llm = cpu_llm(setup["base"], enable_lora=True, max_loras=1, max_lora_rank=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for rid, lora in (("one", LoRARequest("one", 1, str(setup["good"]))),
                      ("two", LoRARequest("two", 2, str(setup["good"]))), ("base", None)):
        engine.add_request({"prompt_token_ids": PROMPT}, params, request_id=rid,
                           lora_request=lora)
    engine.step()
    assert sorted(r.request_id for r in engine.scheduler.running) == ["base", "one"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["two"]
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert sorted(done) == ["base", "one", "two"]
