"""Block-diffusion requests in the scheduler beside autoregressive ones: one token budget,
DENOISE slots charged ``canvas_length`` and writing no cache, ENCODE chunks never sampling."""

from __future__ import annotations

import torch
from inference_engine.config import SchedulerConfig
from inference_engine.diffusion import DiffusionSettings, DiffusionState
from inference_engine.engine.kv_cache import BlockManager
from inference_engine.engine.request import FinishReason, Request
from inference_engine.engine.scheduler import Scheduler
from inference_engine.sampling_params import SamplingParams

CANVAS = 8


def make_scheduler(budget: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(64, 4), max_model_len=512)


def diffusion_request(rid: str, prompt_len: int) -> Request:
    request = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=32))
    request.diffusion = DiffusionState(DiffusionSettings(), CANVAS, torch.Generator())
    return request


def test_ar_and_diffusion_requests_share_the_token_budget():
    scheduler = make_scheduler(budget=20)
    ar = Request("ar", list(range(1, 7)), SamplingParams(max_tokens=8))
    diffusion = diffusion_request("dg", 6)
    scheduler.add(ar)
    scheduler.add(diffusion)
    # Step 1: both prefill (ENCODE for the diffusion request): only the AR chunk samples.
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.samples, s.is_denoise)
            for s in out.scheduled] == [("ar", 6, True, False), ("dg", 6, False, False)]
    scheduler.update_after_step(out)
    ar.append_token(3)
    # Step 2: the AR decode (1 token) and a DENOISE slot of CANVAS budget tokens; a new
    # prompt gets what is left of the budget (20 - 1 - 8 = 11 of its 15 tokens).
    late = Request("late", list(range(100, 115)), SamplingParams(max_tokens=4))
    scheduler.add(late)
    blocks_before = list(scheduler.blocks.req_blocks["dg"])
    out = scheduler.schedule()
    layout = {s.request.request_id: (s.num_new_tokens, s.samples, s.is_denoise)
              for s in out.scheduled}
    assert layout == {"ar": (1, True, False), "dg": (CANVAS, False, True),
                      "late": (11, False, False)}
    assert out.num_tokens == 20
    scheduler.update_after_step(out)
    # The denoise pass computed nothing into the cache and took no blocks.
    assert diffusion.num_computed_tokens == 6
    assert scheduler.blocks.req_blocks["dg"] == blocks_before


def test_committed_block_is_encoded_before_the_next_denoise():
    scheduler = make_scheduler(budget=64)
    request = diffusion_request("dg", 5)
    scheduler.add(request)
    scheduler.update_after_step(scheduler.schedule())
    assert scheduler.schedule().scheduled[0].is_denoise
    for token in range(CANVAS):  # COMMIT: the block's ids become uncached tokens
        request.append_token(10 + token)
    out = scheduler.schedule()
    (slot,) = out.scheduled
    assert (slot.num_new_tokens, slot.samples, slot.is_denoise) == (CANVAS, False, False)
    scheduler.update_after_step(out)
    assert request.num_computed_tokens == 5 + CANVAS


def test_denoise_waits_when_the_budget_cannot_hold_a_canvas():
    scheduler = make_scheduler(budget=CANVAS)
    ar = Request("ar", list(range(100, 104)), SamplingParams(max_tokens=8))
    diffusion = diffusion_request("dg", 3)
    scheduler.add(ar)
    scheduler.add(diffusion)
    scheduler.update_after_step(scheduler.schedule())
    ar.append_token(3)
    # The older AR decode takes 1 of the 8 budget tokens: the canvas (8) waits.
    out = scheduler.schedule()
    assert [(s.request.request_id, s.is_denoise) for s in out.scheduled] == [("ar", False)]
    scheduler.update_after_step(out)
    scheduler.finish(ar, FinishReason.STOP)
    out = scheduler.schedule()
    assert [(s.request.request_id, s.is_denoise) for s in out.scheduled] == [("dg", True)]
