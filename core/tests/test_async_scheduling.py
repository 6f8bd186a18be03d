"""Async scheduling (step N+1 launched before step N's ids are read) changes no output.

The reference is the same engine with async scheduling off, which is itself checked
against transformers by the parity tests. Pending tokens are fed on the device, so
every case here would differ if a placeholder ever reached the model or an output.
"""

from __future__ import annotations

import pytest

from inference_engine import SamplingParams
from inference_engine.testing import cpu_llm, make_tiny_model

PROMPTS = ["The quick brown fox", "hello there", "a b c d e f g", "one",
           "Paged attention stores keys and values"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("async"))


def _outputs(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
             for c in o.outputs] for o in llm.generate(prompts, params)]


def _pair(path, **kwargs):
    return (cpu_llm(path, dtype="float32", async_scheduling=False, **kwargs),
            cpu_llm(path, dtype="float32", async_scheduling=True, **kwargs))


def test_every_sampling_feature_gives_the_synchronous_outputs(model_path):
    params = [SamplingParams(temperature=0.0, max_tokens=20),  # may stop at EOS
              SamplingParams(temperature=0.9, max_tokens=17, seed=5, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=9, stop=["a"],
                             seed=1),
              SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, min_tokens=3),
              SamplingParams(temperature=0.8, max_tokens=15, n=2, seed=7,
                             repetition_penalty=1.3, presence_penalty=0.2)]
    sync, run_ahead = _pair(model_path, block_size=4, max_num_batched_tokens=16)
    assert _outputs(run_ahead, PROMPTS, params) == _outputs(sync, PROMPTS, params)


def test_rows_that_run_ahead_count_their_pending_token(model_path):
    # No row reads its history on the host (no logprobs, penalties or grammar), so every
    # step runs ahead: a seeded draw's number and min_tokens count the token on the device.
    params = [SamplingParams(temperature=0.9, max_tokens=14, seed=5, min_tokens=10),
              SamplingParams(temperature=0.8, top_k=8, max_tokens=11, seed=2),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=7),
              SamplingParams(temperature=1.1, max_tokens=9, seed=11, stop=["e"], min_tokens=4),
              SamplingParams(temperature=0.7, max_tokens=10, seed=9, n=2)]
    sync, run_ahead = _pair(model_path, block_size=4)
    assert _outputs(run_ahead, PROMPTS, params) == _outputs(sync, PROMPTS, params)


def test_preemption_and_chunking_give_the_synchronous_outputs(model_path):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # 10 blocks of 4 tokens for 5 requests of up to ~30 tokens: preemption is forced.
    sync, run_ahead = _pair(model_path, block_size=4, max_num_batched_tokens=8,
                            kv_cache_memory=_pool_bytes(model_path, 10))
    expected = _outputs(sync, PROMPTS, params)
    assert _outputs(run_ahead, PROMPTS, params) == expected
    assert run_ahead.engine.scheduler.num_preemptions > 0


def _pool_bytes(path, blocks):
    probe = cpu_llm(path, dtype="float32", block_size=4, kv_cache_memory=1 << 20)
    return probe.engine.runner.pool.bytes_per_block * blocks


def test_steps_run_ahead_and_stream_only_real_tokens(model_path):
    _, run_ahead = _pair(model_path)
    engine = run_ahead.engine
    engine.add_request("hello there", SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True), request_id="r")
    seen: list[list[int]] = []
    overlapped = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append(list(output.outputs[0].token_ids))
        overlapped += engine._in_flight is not None
    assert overlapped >= 7  # every decode step was launched ahead of its predecessor's read
    assert all(-1 not in ids for ids in seen)
    assert [len(ids) for ids in seen] == list(range(1, 9))


def test_abort_with_a_token_on_the_device(model_path):
    _, run_ahead = _pair(model_path)
    engine = run_ahead.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("hello there", params, request_id="a")
    engine.add_request("one", params, request_id="b")
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    aborted = engine.abort_request("a")
    assert aborted[0].outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert set(finished) == {"b"} and len(finished["b"].outputs[0].token_ids) == 30
    assert engine.blocks.usage == 0.0
