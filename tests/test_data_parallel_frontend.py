"""Data parallelism without torchrun: ``LLM(data_parallel_size=2)`` and ``serve -dp 2``.

The mp executor starts DP rank 1 as a spawned engine (this process is DP rank 0); the front
end sends each request to the rank with the shortest queue and runs both engines' steps in
rounds (gloo, loopback). Greedy tokens of a batch equal one process's (the same engine,
itself tested against transformers in tests/test_engine_parity.py and
plugins/models/tests/test_moe_models.py): a dense model (DP ranks never talk) and a MoE
model with its experts placed over both DP ranks, whose forwards must run in lockstep
(all-gather transport, each rank with different tokens; with an 8-token budget one rank
runs out of work first and joins rounds with dummy forwards). The balance counters show
both ranks took requests; a dead DP rank fails the step by name; the server answers.
"""

from __future__ import annotations

import json
import os
import signal
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

NEW_TOKENS = 8
ENGINE_ARGS = dict(max_num_batched_tokens=8, block_size=4, kv_cache_memory=4 << 20, seed=0)
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _save(path: Path, config, tokenizer) -> Path:
    import transformers

    config.eos_token_id, config.pad_token_id, config.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None)
    torch.manual_seed(0)
    randomize(transformers.AutoModelForCausalLM.from_config(config), std=0.1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tokenizer = train_tiny_tokenizer()
    root = tmp_path_factory.mktemp("dp")
    return {"dense": _save(root / "dense", tiny_dense_config("qwen3", len(tokenizer)), tokenizer),
            "moe": _save(root / "moe", MOE_CONFIGS["qwen3_moe"](len(tokenizer)), tokenizer)}


def _generate(model: Path, **kwargs) -> tuple[list[list[int]], list[str], object, int]:
    """Greedy tokens and texts of the prompts, the DP balance counters (None on one
    process) and DP rank 0's dummy forwards."""
    llm = cpu_llm(model, **ENGINE_ARGS, **kwargs)
    try:
        outputs = llm.generate(PARITY_PROMPTS, PARAMS, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outputs], [o.outputs[0].text for o in outputs],
                getattr(llm.engine, "requests_routed", None),
                getattr(llm.engine.runner, "dummy_forwards", 0))
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def reference(models):
    return {name: _generate(path) for name, path in models.items()}


@pytest.mark.parametrize(("name", "kwargs"), [
    ("dense", {}),
    ("moe", {"enable_expert_parallel": True}),
    # 4 ranks: 2 DP engines of 2 TP ranks each (each DP engine spawns its TP worker).
    ("moe", {"enable_expert_parallel": True, "tensor_parallel_size": 2}),
    ("moe", {"enable_expert_parallel": True, "distributed_executor_backend": "ray"}),
], ids=["dense-dp2", "moe-dp2-ep", "moe-tp2-dp2-ep", "moe-dp2-ep-ray"])
def test_two_dp_ranks_give_one_process_tokens_and_share_the_requests(models, reference, name,
                                                                   kwargs):
    if kwargs.get("distributed_executor_backend") == "ray":
        ray = pytest.importorskip("ray")
    try:
        two, _, routed, dummies = _generate(models[name], data_parallel_size=2, **kwargs)
    finally:
        if kwargs.get("distributed_executor_backend") == "ray":
            ray.shutdown()
    assert two == reference[name][0]
    # Five requests added at once: the shortest queue alternates, rank 0 first.
    assert routed == [3, 2]
    if name == "moe":  # rank 0's prompts are shorter: it joins rounds with dummy forwards
        assert dummies > 0


def test_aborts_reach_the_owning_rank_and_a_dead_dp_rank_fails_the_step_by_name(models):
    """An abort goes to the DP rank holding the request (its final output says so, the
    other request finishes). Then rank 1 is killed between requests: the next round finds
    it (its pipe closed, or the lockstep collective it leaves waiting fails at once)."""
    llm = cpu_llm(models["dense"], data_parallel_size=2, collective_timeout=30.0, **ENGINE_ARGS)
    try:
        engine = llm.engine
        kept, dropped = (engine.add_request(p, PARAMS) for p in PARITY_PROMPTS[:2])
        assert engine.request_ids() == [kept, dropped] and engine.queued == [1, 1]
        engine.step()
        stats = engine.stats()  # both ranks' schedulers: one request each
        assert stats["num_running"] + stats["num_waiting"] == 2
        assert stats["data_parallel_queued"] == [1, 1]
        [aborted] = engine.abort_request(dropped)
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        assert engine.queued == [1, 0]
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in finished] == [kept]
        assert len(finished[0].outputs[0].token_ids) == NEW_TOKENS
        os.kill(llm.engine.remotes[0].pid, signal.SIGKILL)
        with pytest.raises(RankFailedError, match="data-parallel rank 1"):
            llm.generate(PARITY_PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_server_with_dp2_answers_as_one_process_and_turns_unhealthy_when_a_rank_dies(
        models, reference):
    texts = reference["dense"][1]
    server = ServerProcess(models["dense"], "-dp", "2", "--block-size", "4",
                           "--max-num-batched-tokens", "8", platform=TEST_PLATFORM,
                           kv_cache_memory="4MiB")
    try:
        for prompt, text in zip(PARITY_PROMPTS[:2], texts, strict=False):
            status, body = _post(server.url + "/v1/completions", {
                "model": str(models["dense"]), "prompt": prompt, "max_tokens": NEW_TOKENS,
                "temperature": 0.0, "ignore_eos": True})
            assert status == 200, body
            assert body["choices"][0]["text"] == text
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            assert r.status == 200 and b"num_requests_running" in r.read()
        ranks = spawned_children(server.proc.pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        for prompt in PARITY_PROMPTS[:2]:  # one of them goes to the dead rank
            status, body = _post(server.url + "/v1/completions", {
                "model": str(models["dense"]), "prompt": prompt, "max_tokens": 4})
            if status >= 500:
                break
        assert status >= 500 and "data-parallel rank 1" in json.dumps(body), body
        assert _health(server.url) == 503
    finally:
        server.stop()
