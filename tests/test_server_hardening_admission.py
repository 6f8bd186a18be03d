"""n x max_tokens admission (issue 32, item 10): the samples of a request run only as many
at a time as can all reach max_tokens in the KV pool, so a big group neither preempts
itself nor holds up a request that arrives after it."""

from __future__ import annotations

import pytest
from inference_engine import SamplingParams
from inference_engine.config import EngineConfig
from inference_engine.engine.llm_engine import LLMEngine
from inference_engine.testing import TEST_PLATFORM

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    # 128 KiB: 15 blocks of 16 tokens for the tiny model.
    config = EngineConfig.from_kwargs(str(tiny_model_dirs["qwen3"]), kv_cache_memory=1 << 17,
                                      platform=TEST_PLATFORM)
    return LLMEngine(config, show_progress=False)


def run_all(engine: LLMEngine) -> dict[str, object]:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_a_big_group_runs_in_turns_without_preempting(engine):
    prompt_len = len(engine.tokenize_prompt(PROMPT)[1])
    per_sample = -(-(prompt_len + 48) // engine.blocks.block_size)
    # The premise: all six at their longest do not fit the pool, some do.
    limit = engine.blocks.num_blocks // per_sample
    assert 1 < limit < 6
    reference = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    engine.add_request(PROMPT, reference, request_id="alone")
    alone = run_all(engine)["alone"].outputs[0].token_ids

    preemptions = engine.scheduler.num_preemptions
    params = SamplingParams(n=6, max_tokens=48, temperature=0, ignore_eos=True)
    engine.add_request(PROMPT, params, request_id="big")
    assert engine.held.num_held == 6 - limit
    engine.step()
    engine.add_request("Hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       request_id="small")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    # The request that came later did not wait for the whole group, nothing was
    # preempted, and every sample is the greedy text.
    assert [o.request_id for o in finished] == ["small", "big"]
    assert engine.scheduler.num_preemptions == preemptions
    assert engine.held.num_held == 0
    assert [c.token_ids for c in finished[1].outputs] == [alone] * 6


def test_aborting_a_group_with_held_samples_ends_it(engine):
    params = SamplingParams(n=8, max_tokens=48, temperature=0, ignore_eos=True)
    engine.add_request(PROMPT, params, request_id="aborted")
    assert engine.held.num_held > 0
    engine.step()
    (output,) = engine.abort_request("aborted")
    assert output.finished and {c.finish_reason for c in output.outputs} == {"abort"}
    assert engine.held.num_held == 0 and not engine.has_unfinished_requests()
    assert engine.blocks.usage == 0


def test_samples_that_fit_are_not_held(engine):
    params = SamplingParams(n=4, max_tokens=16, temperature=0, ignore_eos=True)
    engine.add_request(PROMPT, params, request_id="fits")
    assert engine.held.num_held == 0
    outputs = run_all(engine)["fits"].outputs
    assert len(outputs) == 4 and all(len(c.token_ids) == 16 for c in outputs)
