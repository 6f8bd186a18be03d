"""Multi-step greedy decoding: when one engine step may run a window of decode steps.

vLLM's former multi-step scheduling, for the case it pays most on a CPU: one greedy
stream. When the only request running is a plain greedy decode (argmax with nothing
that reads its earlier tokens or logits on the host: no logprobs, penalties, logit bias,
allowed or bad words, grammar, min_tokens still to reach), nothing is waiting, and the
model has a greedy window (``CausalLM.greedy_window``, the CPU C++ decode step), the
engine reserves KV slots for K steps and the model computes K tokens in one call; the
engine then applies them one by one with the ordinary stop checks (stop strings, EOS,
``max_tokens``), dropping what follows a stop. K is ``--num-scheduler-steps``, bounded by
the tokens the request may still generate, its room in the context and free blocks.

A request that arrives while a window runs waits for it to end (at most K tokens of the
running stream); the next step is then an ordinary one that admits it. Everything else
(more than one request, sampling, logprobs, speculative decoding, LoRA...) keeps the
one-step path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_engine.engine.kv_cache import BlockManager
from inference_engine.engine.request import Request
from inference_engine.engine.scheduler import Scheduler

__all__ = ["GreedyWindowPlan", "MultiStepPlanner"]


@dataclass(frozen=True, slots=True)
class GreedyWindowPlan:
    """One window to run: the request and how many steps (its slots are allocated)."""

    request: Request
    num_steps: int
    # int64: the ids that end the window early (EOS and stop_token_ids; a plain greedy
    # request has reached its min_tokens, so none of them is masked).
    stop_ids: torch.Tensor


class MultiStepPlanner:
    """Decides, before each engine step, whether it runs as a greedy window.

    Args:
        num_steps: the most steps of one window (``--num-scheduler-steps``).
        scheduler: the engine's scheduler (read: its queues; the request's slots are
            allocated through its block manager).
        blocks: the block manager.
    """

    def __init__(self, num_steps: int, scheduler: Scheduler, blocks: BlockManager) -> None:
        self.num_steps = num_steps
        self.scheduler = scheduler
        self.blocks = blocks
        # Windows run and tokens they produced (stats, tests).
        self.num_windows = 0
        self.num_window_tokens = 0

    def plan(self) -> GreedyWindowPlan | None:
        """The window this step runs, with its KV slots allocated, or None (one step)."""
        scheduler = self.scheduler
        if scheduler.paused or scheduler.waiting or len(scheduler.running) != 1:
            return None
        request = scheduler.running[0]
        if (request.num_pending_tokens or request.spec_token_ids or request.lora is not None
                or request.diffusion is not None or request.encoder_inputs is not None
                or request.num_tokens - request.num_computed_tokens != 1):
            return None
        if not self.is_plain_greedy(request):
            return None
        num_steps = min(self.num_steps,
                        request.max_new_tokens() - len(request.output_token_ids),
                        request.max_model_len - request.num_tokens)
        if num_steps < 2:
            return None
        if not self.blocks.allocate(request.request_id,
                                    request.num_computed_tokens + num_steps):
            return None  # the one-step path handles a full pool (preemption)
        return GreedyWindowPlan(request, num_steps,
                                torch.tensor(sorted(request.eos_token_ids), dtype=torch.int64))

    @staticmethod
    def is_plain_greedy(request: Request) -> bool:
        """Whether the sampler takes the argmax of the raw logits at every step of a window:
        the conditions of ``SamplingBatch.is_plain_greedy`` (nothing masked, biased or
        penalised, no logprobs, ``min_tokens`` reached), and no grammar."""
        p = request.params
        return (p.is_greedy and p.structured_outputs is None and p.logprobs is None
                and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                and p.frequency_penalty == 0.0 and not p.bad_words_token_ids
                and p.allowed_token_ids is None and not p.logit_bias
                and len(request.output_token_ids) >= p.min_tokens)
