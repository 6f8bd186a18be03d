"""LLM / AsyncLLM behaviour end to end on a tiny model: stops, n, seeds, abort, errors, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

SMALL_KV = 1 << 24  # 16 MiB: plenty for these tests, quick to allocate

from inference_engine import AsyncLLM, RequestOutputKind, SamplingParams
from inference_engine.testing import TEST_PLATFORM, cpu_llm
from inference_engine.registry import RemovedArchitectureError, UnknownNameError


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return cpu_llm(str(tiny_model_dirs["qwen3"]), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV, block_size=4)


def test_stop_string_across_tokens_is_cut(llm):
    prompt = "The quick brown fox"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = base.outputs[0].text
    tokenizer = llm.get_tokenizer()
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tokenizer.decode([t]) for t in base.outputs[0].token_ids]
    start = len(pieces[0]) + len(pieces[1]) - 1 if len(pieces[1]) > 1 else len(pieces[0])
    stop = text[start : start + 3]
    assert len(stop) == 3 and text.find(stop) == start
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                              stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:start]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                               stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[: start + 3]


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate("1 2 3", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length" and len(ids) == 10
    stop_id = ids[4]
    out = llm.generate("1 2 3", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               stop_token_ids=[stop_id]))[0].outputs[0]
    first = ids.index(stop_id)
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate("héllo wörld", params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(["1 2 3", "héllo wörld", "def add(a, b):"], [others, params, others])
    assert mixed[1].outputs[0].token_ids == alone


def test_n_parallel_samples(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    out = llm.generate("The quick", params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_prompt_token_ids_input_and_bad_prompts(llm):
    ids = llm.get_tokenizer().encode("The quick")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0))
    assert out[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]})
    with pytest.raises(ValueError, match="context limit"):
        llm.generate({"prompt_token_ids": [5] * 600})


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("The quick brown fox", SamplingParams(max_tokens=50, ignore_eos=True),
                       request_id="to-abort")
    engine.step()
    engine.step()
    assert engine.blocks.req_blocks["to-abort"]
    outs = engine.abort_request("to-abort")
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert "to-abort" not in engine.blocks.req_blocks
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks - 1


def test_final_only_requests_report_once_with_the_incremental_text(llm):
    """LLM.generate's final-only requests: one output each, at the end, whose text equals
    what step-by-step detokenization (streaming) produced and the tokenizer's own decode."""
    engine = llm.engine
    prompts = ["héllo wörld", "The quick brown fox", "1 2 3"]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20 + 3 * i) for i in range(3)]
    texts = {}
    for final_only in (False, True):
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(prompt, p, request_id=f"fo-{final_only}-{i}", final_only=final_only)
        reports: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                reports.setdefault(out.request_id, []).append(out)
        for i in range(3):
            outs = reports[f"fo-{final_only}-{i}"]
            assert outs[-1].finished
            if final_only:
                assert len(outs) == 1
            texts[(final_only, i)] = (outs[-1].outputs[0].text, outs[-1].outputs[0].token_ids)
    tokenizer = llm.get_tokenizer()
    for i in range(3):
        assert texts[(True, i)] == texts[(False, i)]
        text, ids = texts[(True, i)]
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("n", [1, 2])
def test_output_kinds_report_the_same_sequences(llm, n):
    """RequestOutputKind: DELTA outputs concatenate to the CUMULATIVE ones (text, token ids,
    logprobs; prompt logprobs once), FINAL_ONLY reports once; stop strings held back alike."""
    engine = llm.engine
    reports: dict[RequestOutputKind, list] = {}
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0.8, seed=3, n=n, max_tokens=24, logprobs=2,
                                prompt_logprobs=1, stop=["e t"], output_kind=kind)
        engine.add_request("The quick brown fox", params, request_id=f"kind-{kind.name}-{n}")
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        reports[kind] = outs
    cumulative, delta, final = (reports[k] for k in RequestOutputKind)
    assert len(final) == 1 and final[0].finished and len(delta) == len(cumulative) > 1
    assert delta[0].prompt_logprobs == cumulative[0].prompt_logprobs is not None
    assert all(out.prompt_logprobs is None for out in delta[1:])
    for index in range(n):
        def sample(out, i=index):
            return next(c for c in out.outputs if c.index == i)
        text = "".join(sample(out).text for out in delta)
        ids = [t for out in delta for t in sample(out).token_ids]
        logprobs = [e for out in delta for e in sample(out).logprobs]
        last = sample(cumulative[-1])
        assert (text, ids, logprobs) == (last.text, last.token_ids, last.logprobs)
        assert (text, ids) == (sample(final[0]).text, sample(final[0]).token_ids)
        assert sample(delta[-1]).finish_reason == last.finish_reason


def test_output_kind_is_checked():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, temperature=0))
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(out[0].prompt_token_ids).startswith("<|im_start|>user\nhi<|im_end|>")


def test_async_streams_and_abort(tiny_model_dirs):
    engine = AsyncLLM.from_model(str(tiny_model_dirs["qwen3"]), dtype="float32",
                                 kv_cache_memory=SMALL_KV, platform=TEST_PLATFORM)

    async def run():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        seen = []
        async for out in engine.generate("The quick brown fox", params, request_id="s1"):
            seen.append(len(out.outputs[0].token_ids))
        assert seen[-1] == 12 and seen == sorted(seen) and len(seen) > 1

        async def consume():
            last = None
            async for out in engine.generate("1 2 3", SamplingParams(max_tokens=10_000,
                                                                      ignore_eos=True),
                                             request_id="long"):
                last = out
            return last

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        assert await engine.abort("long") == ["long"]
        last = await asyncio.wait_for(task, 10)
        assert last.finished and last.outputs[0].finish_reason == "abort"
        # The event loop stayed responsive while the engine ran.
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(0.01)
        assert asyncio.get_running_loop().time() - t0 < 0.5

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loader_errors_name_the_problem(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["llama"]
    # Unexpected and missing tensors are listed.
    bad = _copy_model(src, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        cpu_llm(str(bad), show_progress=False, kv_cache_memory=SMALL_KV)
    del tensors["model.layers.0.extra.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        cpu_llm(str(bad), show_progress=False, kv_cache_memory=SMALL_KV)
    # Shape mismatch names the tensor.
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].clone()
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight: shape mismatch"):
        cpu_llm(str(bad), show_progress=False, kv_cache_memory=SMALL_KV)
    # Unknown and removed architectures.
    for arch, error, pattern in [("MysteryForCausalLM", UnknownNameError, "LlamaForCausalLM"),
                                 ("Ernie4_5ForCausalLM", RemovedArchitectureError, "removed")]:
        other = _copy_model(src, tmp_path / arch)
        cfg = json.loads((other / "config.json").read_text())
        cfg["architectures"] = [arch]
        (other / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(error, match=pattern):
            cpu_llm(str(other), show_progress=False, kv_cache_memory=SMALL_KV)


def test_sharded_checkpoint_loads(tiny_model_dirs, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shutil.copy(tiny_model_dirs["qwen2"] / "tokenizer.json", tmp_path / "sharded")
    shutil.copy(tiny_model_dirs["qwen2"] / "tokenizer_config.json", tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = cpu_llm(str(tmp_path / "sharded"), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV)
    b = cpu_llm(str(tiny_model_dirs["qwen2"]), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert a.generate("1 2 3", p)[0].outputs[0].token_ids == b.generate("1 2 3", p)[0].outputs[0].token_ids


def test_generate_cli_json(tiny_model_dirs):
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-m", "inference_engine.cli", "generate", "--model",
         str(tiny_model_dirs["qwen3"]), "--prompt", "The quick", "--prompt", "1 2 3",
         "--max-tokens", "5", "--ignore-eos", "--dtype", "float32", "--kv-cache-memory", "16777216", "--json",
         "--platform", TEST_PLATFORM],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [line["prompt"] for line in lines] == ["The quick", "1 2 3"]
    for line in lines:
        assert set(line) == {"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}
        assert len(line["token_ids"]) == 5 and line["finish_reason"] == "length"
    bad = subprocess.run([sys.executable, "-m", "inference_engine.cli", "generate", "--model",
                          "/nonexistent", "--prompt", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "error" in bad.stderr
