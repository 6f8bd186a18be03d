"""Multi-step greedy decode (windows of K steps in one C++ call) against the one-step path
(token for token) and transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.engine.multi_step import MultiStepPlanner
from inference_engine.layers.cpu_gemv import gemv_kernel
from inference_engine.layers.cpu_greedy_window import greedy_window_blocker
from inference_engine.sampling_params import RequestOutputKind
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_parity import assert_greedy_matches

HAS_SIMD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")

pytestmark = pytest.mark.skipif(not HAS_SIMD or gemv_kernel() is None,
                                reason="the packed bf16 GEMV kernel needs AVX-512 or AVX2 and a build")

K = 4
PROMPTS = [list(range(5, 5 + n)) for n in (7, 19)]
# Not a multiple of K: the last window is cut short by max_tokens.
MAX_TOKENS = 23


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engines(request, tmp_path_factory):
    """A bf16 checkpoint served one step at a time and in windows of K steps."""
    path = make_tiny_model(tmp_path_factory.mktemp(f"multi-{request.param}"), request.param,
                           dtype=torch.bfloat16, sliding_window=None)
    one = cpu_llm(path, dtype="bfloat16", num_scheduler_steps=1)
    multi = cpu_llm(path, dtype="bfloat16", num_scheduler_steps=K)
    assert one.engine.multi_step is None
    assert multi.engine.multi_step is not None, greedy_window_blocker(multi.engine.model)
    return path, one, multi


def _run(llm, prompt: list[int], params: SamplingParams):
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]


def _windows(llm) -> int:
    return llm.engine.multi_step.num_windows


def test_windows_equal_one_step_and_transformers(engines):
    path, one, multi = engines
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        before = _windows(multi)
        ours = _run(multi, prompt, params)
        assert _windows(multi) - before == -(-(MAX_TOKENS - 1) // K)
        assert ours.token_ids == _run(one, prompt, params).token_ids
        assert len(ours.token_ids) == MAX_TOKENS and ours.finish_reason == "length"
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(prompt):]
        assert_greedy_matches(hf, prompt, ours.token_ids, ref.tolist())


def test_stop_token_mid_window_ends_it_there(engines):
    """A stop id picked inside a window: the C++ loop stops after it, the output equals the
    one-step path's (tokens, reason) and nothing after it is reported."""
    _, one, multi = engines
    free = _run(one, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True)).token_ids
    # Token 6: the second token of the second window (the first comes from the prompt step).
    stop = free[6]
    first = free.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                            ignore_eos=True)
    ours, ref = _run(multi, PROMPTS[0], params), _run(one, PROMPTS[0], params)
    assert ours.token_ids == ref.token_ids == free[: first + 1]
    assert (ours.finish_reason, ours.stop_reason) == (ref.finish_reason, ref.stop_reason) == (
        "stop", stop)


def test_stop_string_mid_window_truncates(engines):
    _, one, multi = engines
    free = _run(one, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    text = free.text
    middle = len(text) // 2
    stop_string = text[middle : middle + 2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop_string],
                            ignore_eos=True)
    ours, ref = _run(multi, PROMPTS[1], params), _run(one, PROMPTS[1], params)
    assert ref.finish_reason == "stop" and len(ref.token_ids) < MAX_TOKENS
    assert (ours.text, ours.token_ids, ours.finish_reason, ours.stop_reason) == (
        ref.text, ref.token_ids, ref.finish_reason, ref.stop_reason)


def test_abort_after_a_window_and_a_request_arriving_mid_stream(engines):
    """A request arriving while another streams waits for the window to end and is admitted
    at the next step; both equal their one-step outputs. An aborted stream ends at once and
    the engine goes on."""
    _, one, multi = engines
    engine = multi.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, params, request_id="a")
    streamed: dict[str, list[int]] = {"a": [], "b": []}

    def step() -> None:
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].token_ids
            assert len(out.outputs[0].token_ids) <= K

    while len(streamed["a"]) < 6:  # the prompt step, then windows
        step()
    windows = _windows(multi)
    engine.add_request({"prompt_token_ids": PROMPTS[1]}, params, request_id="b")
    step()  # an ordinary step: b's prompt is computed beside a's decode
    assert _windows(multi) == windows and streamed["b"]
    while engine.has_unfinished_requests():
        step()
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        assert streamed[rid] == _run(one, prompt, plain).token_ids
    # b ran alone at the end: in windows again.
    assert _windows(multi) > windows

    engine.add_request({"prompt_token_ids": PROMPTS[1]}, params, request_id="c")
    windows = _windows(multi)
    tokens: list[int] = []
    while len(tokens) < 6:
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert _windows(multi) > windows
    aborted = engine.abort_request("c")
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert tokens == _run(one, PROMPTS[1], plain).token_ids[: len(tokens)]
    assert not engine.has_unfinished_requests() and engine.scheduler.num_running == 0
    assert _run(multi, PROMPTS[0], plain).token_ids == streamed["a"]


def test_requests_a_window_cannot_serve_take_one_step(engines):
    """Sampling, logprobs and a penalty run one step at a time (nothing reads logits in a
    window), with the one-step path's results."""
    _, one, multi = engines
    for params in (SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True),
                   SamplingParams(temperature=0.0, logprobs=2, max_tokens=9, ignore_eos=True),
                   SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=9,
                                  ignore_eos=True)):
        before = _windows(multi)
        ours = _run(multi, PROMPTS[0], params)
        assert _windows(multi) == before
        ref = _run(one, PROMPTS[0], params)
        assert ours.token_ids == ref.token_ids and ours.logprobs == ref.logprobs


def test_planner_bounds_the_window(engines):
    """K is cut to the tokens max_tokens leaves; a one-token remainder takes one step."""
    _, _, multi = engines
    planner: MultiStepPlanner = multi.engine.multi_step
    before = (planner.num_windows, planner.num_window_tokens)
    out = _run(multi, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=K + 2,
                                                 ignore_eos=True))
    # 1 token from the prompt step, one window of K, then 1 token: a single step.
    assert len(out.token_ids) == K + 2
    assert (planner.num_windows - before[0], planner.num_window_tokens - before[1]) == (1, K)
    stats = multi.engine.stats()
    assert (stats["num_greedy_windows"], stats["num_greedy_window_tokens"]) == (
        planner.num_windows, planner.num_window_tokens)


def test_bad_num_scheduler_steps_is_refused():
    from inference_engine.config import SchedulerConfig

    with pytest.raises(ValueError, match="--num-scheduler-steps"):
        SchedulerConfig(num_scheduler_steps=0)


def _planner_with_running(num_blocks: int, prompt_len: int = 6, max_tokens: int = 64,
                          **params):
    """A planner over a scheduler whose one request has run its prompt and sampled once."""
    from inference_engine.config import SchedulerConfig
    from inference_engine.engine.kv_cache import BlockManager
    from inference_engine.engine.request import Request
    from inference_engine.engine.scheduler import Scheduler

    blocks = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), blocks,
                          256)
    request = Request("r", list(range(1, 1 + prompt_len)),
                      SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))
    scheduler.add(request)
    out = scheduler.schedule()
    scheduler.update_after_step(out)
    request.append_token(7)
    return MultiStepPlanner(K, scheduler, blocks), scheduler, blocks, request


def test_planner_allocates_the_window_or_leaves_the_step_to_the_scheduler():
    planner, _, blocks, request = _planner_with_running(num_blocks=8)
    plan = planner.plan()
    assert plan is not None and plan.request is request and plan.num_steps == K
    # Slots for positions 6..9 (the last known token and K - 1 picks): 10 tokens, 3 blocks.
    assert len(blocks.req_blocks["r"]) == 3
    # A pool with no block for the window: no plan, nothing taken.
    planner, _, blocks, _ = _planner_with_running(num_blocks=3, prompt_len=8)
    held = list(blocks.req_blocks["r"])
    assert planner.plan() is None and blocks.req_blocks["r"] == held


def test_planner_refuses_what_a_window_cannot_serve():
    planner, scheduler, _, _ = _planner_with_running(num_blocks=16)
    from inference_engine.engine.request import Request

    scheduler.add(Request("w", [1, 2, 3], SamplingParams(temperature=0.0)))
    assert planner.plan() is None  # a request waits: it is admitted first
    for params in ({"min_tokens": 5}, {"logit_bias": {3: 1.0}}, {"allowed_token_ids": [1, 2]},
                   {"presence_penalty": 0.5}):
        planner, _, _, _ = _planner_with_running(num_blocks=16, **params)
        assert planner.plan() is None, params
    planner, _, _, _ = _planner_with_running(num_blocks=16, max_tokens=2)
    assert planner.plan() is None  # one token left: an ordinary step
    planner, _, _, _ = _planner_with_running(num_blocks=16, max_tokens=3)
    assert planner.plan().num_steps == 2
