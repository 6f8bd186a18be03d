"""Scheduler and block manager without a model (vLLM's tests/v1/core style).

Requests are built by hand, a "step" is ``schedule()`` then ``update_after_step()``
then one sampled token per sampling request, as the engine does. Block size 4
throughout; block 0 is the reserved padding block, so a pool of ``n`` blocks
hands out ``n - 1``.
"""

from __future__ import annotations

import pytest

from inference_engine.config import SchedulerConfig
from inference_engine.engine.kv_cache import BlockManager
from inference_engine.engine.request import FinishReason, Request, RequestStatus
from inference_engine.engine.scheduler import Scheduler, SchedulerOutput
from inference_engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 33, max_num_batched_tokens: int = 16,
                   max_num_seqs: int = 8, enable_chunked_prefill: bool = True,
                   enable_prefix_caching: bool = True, max_model_len: int = 256) -> Scheduler:
    blocks = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=enable_chunked_prefill)
    return Scheduler(config, blocks, max_model_len)


def make_request(request_id: str, num_tokens: int = 0, token_ids: list[int] | None = None,
                 max_tokens: int = 64, prompt_logprobs: int | None = None) -> Request:
    """A request whose prompt is ``token_ids`` or ``num_tokens`` ids unique to it."""
    if token_ids is None:
        base = 1000 * (abs(hash(request_id)) % 1000 + 1)
        token_ids = list(range(base, base + num_tokens))
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Request(request_id, list(token_ids), params)


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step: schedule, advance the computed counts, append a sampled token."""
    out = scheduler.schedule()
    scheduler.update_after_step(out)
    for s in out.scheduled:
        if s.samples and not s.request.is_finished:
            s.request.append_token(token)
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled]


def num_usable(scheduler: Scheduler) -> int:
    return scheduler.blocks.num_blocks - 1


# ---- budget -------------------------------------------------------------------------
def test_decodes_first_then_prefill_chunks_up_to_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    a, b = make_request("a", 6), make_request("b", 6)
    scheduler.add(a)
    scheduler.add(b)
    assert shape(step(scheduler)) == [("a", 6, True), ("b", 6, True)]

    c = make_request("c", 20)
    scheduler.add(c)
    out = step(scheduler)
    # Running decodes take one token each; the new prompt gets the rest of the budget.
    assert shape(out) == [("a", 1, True), ("b", 1, True), ("c", 14, False)]
    assert out.num_tokens == 16
    assert c.num_computed_tokens == 14 and c.output_token_ids == []

    out = step(scheduler)
    assert shape(out) == [("a", 1, True), ("b", 1, True), ("c", 6, True)]
    assert c.num_computed_tokens == 20 and len(c.output_token_ids) == 1


def test_scheduled_order_puts_single_token_queries_first():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    a = make_request("a", 5)
    scheduler.add(a)
    step(scheduler)
    b = make_request("b", 9)
    scheduler.add(b)
    step(scheduler)  # a decodes, b prefills
    c = make_request("c", 3)
    scheduler.add(c)
    out = step(scheduler)
    # Running order is a, b; b and a are decodes now, c a prefill: decodes first.
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 3]
    assert [s.request.request_id for s in out.scheduled][-1] == "c"


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    requests = [make_request(name, 4) for name in "abc"]
    for request in requests:
        scheduler.add(request)
    out = step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    assert requests[2].status is RequestStatus.WAITING
    scheduler.abort("a")
    out = step(scheduler)
    assert shape(out) == [("b", 1, True), ("c", 4, True)]


def test_a_budget_used_up_by_decodes_leaves_the_prompt_waiting():
    scheduler = make_scheduler(max_num_batched_tokens=2)
    for name in "ab":
        scheduler.add(make_request(name, 1))
    step(scheduler)
    scheduler.add(make_request("c", 4))
    out = step(scheduler)
    assert shape(out) == [("a", 1, True), ("b", 1, True)]
    assert scheduler.num_waiting == 1 and scheduler.waiting[0].num_computed_tokens == 0


# ---- chunked prefill ------------------------------------------------------------------
def test_chunked_prefill_spreads_a_prompt_over_steps_and_samples_on_the_last_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", 10)
    scheduler.add(request)
    seen = []
    for _ in range(3):
        before = request.num_computed_tokens
        out = step(scheduler)
        (s,) = out.scheduled
        seen.append((before, s.num_new_tokens, s.samples, len(s.block_ids)))
    # Each chunk starts where the last ended; blocks grow with the computed tokens.
    assert seen == [(0, 4, False, 1), (4, 4, False, 2), (8, 2, True, 3)]
    assert request.output_token_ids == [7]
    out = step(scheduler)
    assert shape(out) == [("a", 1, True)]


def test_chunked_prefill_off_schedules_a_prompt_only_whole():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = make_request("a", 6), make_request("b", 6)
    scheduler.add(a)
    scheduler.add(b)
    # b's 6 tokens do not fit the 2 left: it waits rather than being cut.
    assert shape(step(scheduler)) == [("a", 6, True)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert shape(step(scheduler)) == [("a", 1, True), ("b", 6, True)]


def test_chunked_prefill_off_refuses_a_prompt_over_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add(make_request("a", 9))
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens"):
        scheduler.schedule()


# ---- preemption -------------------------------------------------------------------------
def test_preempts_newest_when_out_of_blocks():
    # 6 usable blocks: three 8-token prompts take two each, then each decode needs a third.
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=64,
                               enable_prefix_caching=False)
    a, b, c = (make_request(name, 8) for name in "abc")
    for request in (a, b, c):
        scheduler.add(request)
    step(scheduler)
    assert scheduler.blocks.num_free_blocks == 0

    out = step(scheduler)
    # a needs a block: c (the newest) is preempted, and its two blocks serve a and b.
    assert out.preempted == [c]
    assert shape(out) == [("a", 1, True), ("b", 1, True)]
    assert c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and "c" not in scheduler.blocks.req_blocks
    assert list(scheduler.waiting) == [c] and scheduler.running == [a, b]
    assert scheduler.num_preemptions == 1
    assert scheduler.blocks.num_free_blocks == 0

    # Once room frees up, c is recomputed from scratch: prompt and its sampled token.
    scheduler.abort("a")
    out = step(scheduler)
    assert ("c", 9, True) in shape(out)
    assert c.status is RequestStatus.RUNNING and c.num_computed_tokens == 9


def test_preempted_request_goes_to_the_front_of_the_queue():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64, max_num_seqs=2,
                               enable_prefix_caching=False)
    a, b, d = make_request("a", 8), make_request("b", 8), make_request("d", 4)
    for request in (a, b, d):
        scheduler.add(request)
    step(scheduler)  # a and b fill the pool, d waits (max_num_seqs)
    out = step(scheduler)
    assert out.preempted == [b]
    assert list(scheduler.waiting) == [b, d]


def test_the_newest_request_needing_a_block_preempts_itself():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64,
                               enable_prefix_caching=False)
    b, a = make_request("b", 6), make_request("a", 8)
    scheduler.add(b)
    scheduler.add(a)
    step(scheduler)  # two blocks each; b's next token still fits its second block
    out = step(scheduler)
    assert out.preempted == [a] and out.failed == []
    assert shape(out) == [("b", 1, True)]
    assert list(scheduler.waiting) == [a] and a.status is RequestStatus.PREEMPTED
    assert scheduler.blocks.num_free_blocks == 2  # too few for a's 9 tokens: it waits


# ---- prefix cache -------------------------------------------------------------------------
def test_prefix_cache_hit_starts_at_a_full_block_boundary():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    prompt = list(range(100, 110))
    a = make_request("a", token_ids=prompt)
    scheduler.add(a)
    step(scheduler)
    stats = scheduler.blocks.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (10, 0)

    # Shares 9 tokens with a: two full blocks (8 tokens) are reused, not the partial third.
    b = make_request("b", token_ids=prompt[:9] + [999])
    scheduler.add(b)
    out = step(scheduler)
    assert ("b", 2, True) in shape(out)
    assert scheduler.blocks.req_blocks["b"][:2] == scheduler.blocks.req_blocks["a"][:2]
    assert scheduler.blocks.req_blocks["b"][2] != scheduler.blocks.req_blocks["a"][2]
    assert (stats.queried_tokens, stats.hit_tokens) == (20, 8)
    assert stats.hit_rate == pytest.approx(0.4)


def test_prefix_cache_hit_always_leaves_a_token_to_compute():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    prompt = list(range(100, 108))
    scheduler.add(make_request("a", token_ids=prompt))
    step(scheduler)
    b = make_request("b", token_ids=prompt)  # identical, exactly two blocks
    scheduler.add(b)
    out = step(scheduler)
    # Only the first block is reused: the last block's tokens run so the step has logits.
    assert ("b", 4, True) in shape(out)
    assert scheduler.blocks.stats.hit_tokens == 4


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    prompt = list(range(100, 110))
    scheduler.add(make_request("a", token_ids=prompt))
    step(scheduler)
    b = make_request("b", token_ids=prompt, prompt_logprobs=1)
    scheduler.add(b)
    out = step(scheduler)
    assert ("b", 10, True) in shape(out)


def test_prefix_cache_off_never_matches():
    scheduler = make_scheduler(max_num_batched_tokens=64, enable_prefix_caching=False)
    prompt = list(range(100, 110))
    scheduler.add(make_request("a", token_ids=prompt))
    step(scheduler)
    scheduler.add(make_request("b", token_ids=prompt))
    assert ("b", 10, True) in shape(step(scheduler))
    assert scheduler.blocks.stats.hit_tokens == 0


def test_blocks_are_reusable_as_soon_as_a_chunk_fills_them():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(100, 112))
    a = make_request("a", token_ids=prompt)
    scheduler.add(a)
    step(scheduler)  # a is mid-prefill: 8 computed, two full blocks
    b = make_request("b", token_ids=prompt)
    scheduler.add(b)
    out = step(scheduler)
    assert shape(out) == [("a", 4, True), ("b", 4, True)]
    assert scheduler.blocks.stats.hit_tokens == 8
    assert scheduler.blocks.req_blocks["b"][:2] == scheduler.blocks.req_blocks["a"][:2]


# ---- block manager: reference counts and LRU ---------------------------------------------
def test_shared_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    tokens = list(range(9))
    assert bm.match_prefix("a", tokens) == 0
    assert bm.allocate("a", 9)
    bm.cache_full_blocks("a", tokens, 9)
    shared = bm.req_blocks["a"][:2]
    assert bm.match_prefix("b", tokens) == 8
    assert bm.req_blocks["b"] == shared
    assert [bm._ref[block] for block in shared] == [2, 2]
    free_before = bm.num_free_blocks

    bm.free("a")
    # b still holds the shared blocks: only a's private third block came back.
    assert [bm._ref[block] for block in shared] == [1, 1]
    assert bm.num_free_blocks == free_before + 1
    bm.free("b")
    assert [bm._ref[block] for block in shared] == [0, 0]
    assert bm.num_free_blocks == 5
    # Freed but cached: a third request still finds them.
    assert bm.match_prefix("c", tokens) == 8


def test_cached_free_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)  # 3 usable blocks
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    for name, tokens in (("a", first), ("b", second)):
        assert bm.allocate(name, 4)
        bm.cache_full_blocks(name, tokens, 4)
        bm.free(name)
    # Touch `first` again: `second` is now the least recently used.
    assert bm.match_prefix("c", first + [0]) == 4
    bm.free("c")
    assert bm.num_free_blocks == 3

    assert bm.allocate("d", 8)  # takes the never-used block, then evicts one cached block
    bm.free("d")
    assert bm.match_prefix("e", first + [0]) == 4
    assert bm.match_prefix("f", second + [0]) == 0


def test_never_used_blocks_are_taken_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    assert bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    bm.free("a")
    assert bm.allocate("b", 8)  # the two blocks never used
    assert bm.match_prefix("c", [1, 2, 3, 4, 5]) == 4


def test_allocate_refuses_without_taking_anything():
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    assert bm.allocate("a", 8)
    assert not bm.allocate("b", 8)
    assert bm.req_blocks.get("b", []) == [] and bm.num_free_blocks == 1


# ---- abort ----------------------------------------------------------------------------------
def _assert_aborted(scheduler: Scheduler, request: Request) -> None:
    assert request.status is RequestStatus.FINISHED
    assert request.finish_reason is FinishReason.ABORT
    assert request not in scheduler.running and request not in scheduler.waiting
    assert request.request_id not in scheduler.blocks.req_blocks
    assert request.request_id not in scheduler.requests


def test_abort_a_waiting_request():
    scheduler = make_scheduler()
    request = make_request("a", 5)
    scheduler.add(request)
    assert scheduler.abort("a") is request
    _assert_aborted(scheduler, request)
    assert not scheduler.has_unfinished()
    assert scheduler.schedule().is_empty


def test_abort_mid_prefill_frees_its_blocks():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", 10)
    scheduler.add(request)
    step(scheduler)
    assert request.num_computed_tokens == 4 and scheduler.blocks.num_free_blocks < num_usable(scheduler)
    scheduler.abort("a")
    _assert_aborted(scheduler, request)
    assert scheduler.blocks.num_free_blocks == num_usable(scheduler)


def test_abort_a_decoding_request_frees_its_blocks():
    scheduler = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    step(scheduler)
    scheduler.abort("a")
    _assert_aborted(scheduler, a)
    assert shape(step(scheduler)) == [("b", 1, True)]
    scheduler.abort("b")
    assert scheduler.blocks.num_free_blocks == num_usable(scheduler)


def test_abort_a_preempted_request():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64,
                               enable_prefix_caching=False)
    a, b = make_request("a", 8), make_request("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert step(scheduler).preempted == [b]
    assert b.status is RequestStatus.PREEMPTED
    assert scheduler.abort("b") is b
    _assert_aborted(scheduler, b)
    scheduler.abort("a")
    assert scheduler.blocks.num_free_blocks == num_usable(scheduler)


def test_abort_unknown_or_finished_is_none():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", 3))
    assert scheduler.abort("nope") is None
    assert scheduler.abort("a") is not None
    assert scheduler.abort("a") is None


def test_request_ids_are_unique_while_in_flight():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add(make_request("a", 3))


# ---- too long for the pool -------------------------------------------------------------------
def test_a_request_larger_than_the_pool_fails_and_the_rest_proceed():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)  # 16 tokens of cache
    big, small = make_request("big", 17), make_request("small", 4)
    scheduler.add(big)
    scheduler.add(small)
    out = scheduler.schedule()
    assert out.failed == [(big, "the request does not fit in the KV cache")]
    assert big.status is RequestStatus.FINISHED and big.finish_reason is FinishReason.LENGTH
    assert "big" not in scheduler.blocks.req_blocks
    assert shape(out) == [("small", 4, True)]


def test_a_request_that_fills_the_pool_exactly_is_not_failed():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    request = make_request("a", 16)
    scheduler.add(request)
    out = scheduler.schedule()
    assert out.failed == [] and shape(out) == [("a", 16, True)]


def test_a_chunked_request_larger_than_the_pool_fails_instead_of_cycling():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=8,
                               enable_prefix_caching=False)
    request = make_request("big", 17)
    scheduler.add(request)
    for _ in range(12):
        out = step(scheduler)
        if request.is_finished:
            break
    assert request.is_finished and request.finish_reason is FinishReason.LENGTH
    assert out.failed == [(request, "the request does not fit in the KV cache")]


def test_a_chunked_request_larger_than_the_pool_fails_with_the_prefix_cache():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=8)
    request = make_request("big", 17)
    scheduler.add(request)
    out = step(scheduler)  # failed before any chunk is computed
    assert len(out.failed) == 1 and not out.scheduled
    assert request.finish_reason is FinishReason.LENGTH
    assert scheduler.blocks.num_free_blocks == num_usable(scheduler)
