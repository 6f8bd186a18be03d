"""Tensor and expert parallelism on the CPU with gloo: 2 ranks give one process's tokens.

Each case runs a tiny random model (dense Qwen3 with one KV head, so it is replicated
over both ranks; DeepSeek-V2 with MLA attention and MoE experts split by TP; Qwen3-MoE
with experts placed over 2 EP ranks, both transports) through ``LLM(tensor_parallel_size=2)``
(the mp executor: the test process is rank 0, one spawned worker is rank 1) and compares
its greedy tokens with the same engine on one process (itself checked against transformers
in tests/test_engine_parity.py and plugins/models/tests/test_moe_models.py). Chunked
prefill with a small token budget mixes prefills and decodes in one step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from inference_engine import SamplingParams
from inference_engine.distributed.executor import RankFailedError
from inference_engine.testing import (
    TEST_PLATFORM,
    ServerProcess,
    cpu_llm,
    spawned_children,
    train_tiny_tokenizer,
)
from inference_engine.testing_parity import (
    MOE_CONFIGS,
    PARITY_PROMPTS,
    randomize,
    tiny_dense_config,
)

NEW_TOKENS = 10
ENGINE_ARGS = dict(max_num_batched_tokens=24, block_size=4, kv_cache_memory=4 << 20, seed=0)


def _save(path: Path, config, tokenizer) -> Path:
    import transformers

    config.eos_token_id, config.pad_token_id, config.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None)
    torch.manual_seed(0)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config), std=0.1)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tokenizer = train_tiny_tokenizer()
    vocab = len(tokenizer)
    root = tmp_path_factory.mktemp("dist")
    return {
        # One KV head for two ranks: replicated; tied embeddings: the vocab-parallel embedding
        # is the LM head.
        "dense": _save(root / "dense", tiny_dense_config(
            "qwen3", vocab, head_dim=16, num_key_value_heads=1, tie_word_embeddings=True),
            tokenizer),
        "mla": _save(root / "mla", MOE_CONFIGS["deepseek_v2"](vocab), tokenizer),
        "moe": _save(root / "moe", MOE_CONFIGS["qwen3_moe"](vocab), tokenizer),
    }


def greedy(llm, texts: list[str] | None = None) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PARITY_PROMPTS, params, use_tqdm=False)
    if texts is not None:
        texts.extend(o.outputs[0].text for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def run(model: Path, texts: list[str] | None = None, **kwargs) -> list[list[int]]:
    llm = cpu_llm(model, **ENGINE_ARGS, **kwargs)
    try:
        return greedy(llm, texts)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def reference(models):
    """One process's greedy tokens (and the MoE model's texts, for the server test)."""
    result = {name: run(path) for name, path in models.items() if name != "moe"}
    result["moe_texts"] = []
    result["moe"] = run(models["moe"], result["moe_texts"])
    return result


@pytest.mark.parametrize(("name", "kwargs"), [
    ("dense", {}),
    ("mla", {}),  # MLA heads and the MoE experts' widths split over 2 ranks
    ("moe", {"enable_expert_parallel": True}),  # all-gather / all-reduce transport
    ("moe", {"enable_expert_parallel": True, "all2all_backend": "alltoall"}),
], ids=["dense-tp2", "mla-moe-tp2", "moe-ep2-allgather", "moe-ep2-alltoall"])
def test_two_ranks_match_one_process(models, reference, name, kwargs):
    tokens = run(models[name], tensor_parallel_size=2, **kwargs)
    assert tokens == reference[name]


def test_expert_load_is_counted_under_expert_parallelism(models):
    llm = cpu_llm(models["moe"], tensor_parallel_size=2, enable_expert_parallel=True,
                  **ENGINE_ARGS)
    try:
        greedy(llm)
        load = llm.engine.expert_load()
    finally:
        llm.engine.shutdown()
    # Every (token, slot) assignment of every MoE layer is counted once: top-2 of 8 experts.
    assert set(load) == {0, 1} and all(len(v) == 8 for v in load.values())
    assert all(sum(v) % 2 == 0 and sum(v) > 0 for v in load.values())


def test_dead_rank_fails_the_request_not_hangs(models):
    """Rank 1 is killed while requests are generating (its collective partner fails at
    once) and, on a fresh engine, between requests (found before the next step)."""
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for mid_request in (True, False):
        llm = cpu_llm(models["dense"], tensor_parallel_size=2, collective_timeout=30.0,
                      **ENGINE_ARGS)
        try:
            greedy(llm)  # warm: kernels built, so the kill cannot land in a build
            pid = llm.engine.executor.pids[0]
            start = time.monotonic()
            if mid_request:
                threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
            else:
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(RankFailedError, match="rank 1"):
                for _ in range(50):  # the kill lands during one of these
                    llm.generate(PARITY_PROMPTS, long, use_tqdm=False)
            assert time.monotonic() - start < 30
        finally:
            llm.engine.shutdown()


def _post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_server_serves_tp2_expert_parallel_and_turns_unhealthy_when_a_rank_dies(models,
                                                                              reference):
    server = ServerProcess(models["moe"], "-tp", "2", "--enable-expert-parallel",
                           "--block-size", "4", "--max-num-batched-tokens", "24",
                           platform=TEST_PLATFORM, kv_cache_memory="4MiB")
    try:
        for prompt, text in zip(PARITY_PROMPTS[:2], reference["moe_texts"], strict=False):
            status, body = _post(server.url + "/v1/completions", {
                "model": str(models["moe"]), "prompt": prompt, "max_tokens": NEW_TOKENS,
                "temperature": 0.0, "ignore_eos": True})
            assert status == 200, body
            assert body["choices"][0]["text"] == text
        status, metrics = _get(server.url + "/metrics")
        assert status == 200 and 'inference_engine:moe_expert_load_total{' in metrics
        workers = spawned_children(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        status, body = _post(server.url + "/v1/completions", {
            "model": str(models["moe"]), "prompt": PARITY_PROMPTS[0], "max_tokens": 4})
        assert status >= 500 and "rank 1" in json.dumps(body), body
        assert _get(server.url + "/health")[0] == 503
        assert time.monotonic() - start < 30
    finally:
        server.stop()


def torchrun(model: Path, nproc: int, out: Path, *flags: str, **engine_args) -> list[dict]:
    """scripts/torchrun_generate.py under ``torchrun --standalone``; each rank's report."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "torchrun_generate.py"
    prompts = [arg for p in PARITY_PROMPTS for arg in ("--prompt", p)]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(script), str(model), *prompts, "--max-tokens", str(NEW_TOKENS),
         "--platform", TEST_PLATFORM, "--engine-args", json.dumps({**ENGINE_ARGS, **engine_args}),
         "--json-out", str(out), *flags],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def test_torchrun_external_launcher_gives_the_same_tokens(models, reference, tmp_path):
    for report in torchrun(models["dense"], 2, tmp_path):
        assert report["token_ids"] == reference["dense"]


def test_torchrun_tp2_x_dp2_expert_parallel_gives_the_same_tokens(models, reference, tmp_path):
    """4 ranks: 2 DP engines (each its own scheduler and KV cache, prompts shared out by
    queued work) of 2 TP ranks; the MoE experts over all 4 (all-to-all); the DP rank that
    runs out of work first keeps stepping with dummy forwards until the other is done."""
    # An 8-token budget: the DP rank with the long prompt needs more steps than the other.
    reports = torchrun(models["moe"], 4, tmp_path, "--data-parallel-size", "2",
                       "--enable-expert-parallel", "--all2all-backend", "alltoall",
                       max_num_batched_tokens=8)
    for report in reports:
        assert report["token_ids"] == reference["moe"]
    assert sum(r["dummy_forwards"] for r in reports) > 0


def test_ray_executor_on_a_local_cluster_gives_the_same_tokens(models, reference):
    ray = pytest.importorskip("ray")
    try:
        tokens = run(models["dense"], tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert tokens == reference["dense"]


def test_fp8_block_checkpoint_shards_its_scales_under_tp2(tmp_path):
    """FP8 with 128x128 block scales (``inference-engine quantize --method fp8-block``): each
    rank loads its rows / columns of the weights and the matching blocks of the scales
    (every per-rank slice a whole number of blocks), and decodes as one process. (Only 6
    tokens: this random model meets an FP8 near-tie, logprob gap 0.05, at token 9.)"""
    from inference_engine_quant.quantize_cli import quantize_checkpoint

    tokenizer = train_tiny_tokenizer()
    config = tiny_dense_config("qwen3", len(tokenizer), hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    base = _save(tmp_path / "base", config, tokenizer)
    quantize_checkpoint(base, tmp_path / "fp8", "fp8-block", show_progress=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = PARITY_PROMPTS[:3]
    tokens = []
    for kwargs in ({}, {"tensor_parallel_size": 2}):
        llm = cpu_llm(tmp_path / "fp8", **ENGINE_ARGS, **kwargs)
        try:
            assert type(llm.engine.model.model.layers[0].mlp.down_proj.quant_method
                        ).__name__ == "Fp8Method"
            tokens.append([o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    assert tokens[1] == tokens[0]
