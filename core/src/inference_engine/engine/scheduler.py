"""Continuous batching with chunked prefill, FCFS admission and recompute preemption."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from inference_engine.config import SchedulerConfig
from inference_engine.engine.kv_cache import BlockManager
from inference_engine.engine.request import FinishReason, Request, RequestStatus

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    # Tokens computed this step, starting at request.num_computed_tokens.
    num_new_tokens: int
    # True when this chunk reaches the end of the known tokens, so a token is sampled.
    samples: bool
    # The request's physical KV blocks (the block manager's list for it).
    block_ids: list[int] = field(default_factory=list)
    # Draft tokens verified this step (the last ones of ``num_new_tokens``); their slots are
    # rolled back by :meth:`Scheduler.rollback_rejected` once the verdict is known.
    num_spec_tokens: int = 0
    # Block diffusion DENOISE: one decoder pass over the request's canvas (``num_new_tokens``
    # is the canvas length, charged to the budget); nothing is written to the cache.
    is_denoise: bool = False


@dataclass
class SchedulerOutput:
    """One step's work, ordered single-token queries first (what backends expect)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests the scheduler ended by itself this step, with why (too long for the pool).
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides which requests run each step and how many tokens each computes.

    Running requests go first (oldest first), then waiting ones FCFS while
    the token budget and ``max_num_seqs`` allow. When a running request needs
    a block and none is free, the newest running request is preempted: its
    blocks are freed and it goes back to the front of the queue to be
    recomputed, so nothing is ever dropped.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.paused = False
        self.num_preemptions = 0
        # Distinct LoRA adapters that may run at once (the device slots); None: no LoRA.
        self.max_loras: int | None = None
        # Speculative decoding: KV slots a sampling request holds past its step for a model
        # drafter to write its drafts' K/V (0: none, or no drafter cache).
        self.num_lookahead_slots = 0

    # ---- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Run a request whose cache is filled already (a forked sample holding its parent's
        prompt): it joins the running requests, from the next step on, with
        ``num_computed_tokens`` as set."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request in any state, freeing its blocks; None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.blocks.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling -------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.paused:
            return out
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            if request.diffusion is not None and remaining == 0:
                # Block diffusion with every token cached: DENOISE its canvas (C queries of
                # budget, no new slots: the canvas K/V are scratch), or wait for budget.
                canvas = request.diffusion.canvas_length
                if canvas <= budget:
                    scheduled.append(ScheduledRequest(request, canvas, False, is_denoise=True))
                    budget -= canvas
                i += 1
                continue
            if request.num_pending_tokens and (remaining == 0 or request.will_stop_by_length()):
                # Async scheduling: its last token is still on the device and ends it.
                i += 1
                continue
            num_spec = len(request.spec_token_ids)
            if num_spec:
                # Drafts ride along only after the last known token and within the budget.
                num_spec = max(0, min(num_spec, budget - remaining)) if remaining == 1 else 0
                del request.spec_token_ids[num_spec:]
            num_new = min(remaining + num_spec, budget)
            samples = num_new == remaining + num_spec
            target = (request.num_computed_tokens + num_new if not self.num_lookahead_slots
                      else self._slots_needed(request, num_new, samples))
            while not self.blocks.allocate(request.request_id, target):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break
            scheduled.append(ScheduledRequest(request, num_new, samples, num_spec_tokens=num_spec))
            budget -= num_new
            i += 1

        # A step that had to preempt admits nothing new (vLLM's rule): the pool is full, and
        # a victim re-admitted at once would only be preempted again.
        # Requests passed over because their LoRA adapter has no free slot (vLLM's rule: later
        # requests may go ahead); they go back to the front, in order, below.
        lora_skipped: list[Request] = []
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_pending_tokens:
                break  # preempted with a token still on the device: recompute once it is read
            if self._lora_slots_full(request):
                lora_skipped.append(self.waiting.popleft())
                continue
            if -(-request.num_tokens // self.blocks.block_size) > self.blocks.num_blocks - 1:
                # Even alone in the pool it does not fit: it never will (checked before any
                # chunk runs, so a chunked prompt cannot fill the pool and cycle).
                self.waiting.popleft()
                self._fail_too_long(request)
                out.failed.append((request, "the request does not fit in the KV cache"))
                continue
            if request.num_computed_tokens == 0 and request.params.prompt_logprobs is None:
                request.num_computed_tokens = self.blocks.match_prefix(
                    request.request_id, request.all_token_ids, request.prefix_salt
                )
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                if scheduled:
                    break
                if remaining > self.config.max_num_batched_tokens:
                    self.waiting.extendleft(reversed(lora_skipped))
                    raise ValueError(
                        f"prompt of {remaining} tokens exceeds max_num_batched_tokens "
                        f"({self.config.max_num_batched_tokens}) with chunked prefill off"
                    )
            if not self.blocks.allocate(request.request_id,
                                        self._slots_needed(request, num_new, num_new == remaining)):
                # Give back prefix-matched blocks: a waiting request holds nothing.
                self.blocks.free(request.request_id)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, num_new == remaining))
            budget -= num_new
        self.waiting.extendleft(reversed(lora_skipped))

        req_blocks = self.blocks.req_blocks
        for s in scheduled:
            if s.request.diffusion is not None:
                s.samples = False  # block diffusion samples in DENOISE, not after ENCODE
            s.block_ids = req_blocks[s.request.request_id]
        scheduled.sort(key=_multi_token_last)
        out.scheduled = scheduled
        return out

    def _slots_needed(self, request: Request, num_new: int, samples: bool) -> int:
        """Tokens' worth of KV the request must hold to compute ``num_new`` more: a step that
        samples also reserves the drafter's lookahead slots (never past the context)."""
        target = request.num_computed_tokens + num_new
        if samples and self.num_lookahead_slots:
            target = min(target + self.num_lookahead_slots, self.max_model_len)
        return target

    def _lora_slots_full(self, request: Request) -> bool:
        """Whether admitting ``request`` would run more distinct adapters than slots."""
        if self.max_loras is None or request.lora is None:
            return False
        running = {r.lora_int_id for r in self.running} - {0}
        return request.lora_int_id not in running and len(running) >= self.max_loras

    def _fail_too_long(self, request: Request) -> None:
        logger.warning(
            "request %s needs more KV blocks than the whole pool holds; finishing it",
            request.request_id,
        )
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        self.finish(request, FinishReason.LENGTH)

    def rollback_rejected(self, scheduled: ScheduledRequest, num_accepted: int) -> None:
        """After verification: give back the computed count of the rejected drafts (their
        slots stay allocated and are overwritten later) and hash the verified blocks."""
        request = scheduled.request
        request.spec_token_ids = []
        if request.is_finished:
            return
        request.num_computed_tokens -= scheduled.num_spec_tokens - num_accepted
        self.blocks.cache_full_blocks(
            request.request_id, request.all_token_ids, request.num_computed_tokens,
            request.prefix_salt
        )

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and register newly full blocks for prefix reuse."""
        hashing = self.blocks.enable_prefix_caching
        bs = self.blocks.block_size
        finished = RequestStatus.FINISHED
        for s in out.scheduled:
            request = s.request
            if request.status is finished or s.is_denoise:
                continue
            request.num_computed_tokens += s.num_new_tokens
            if s.num_spec_tokens or not hashing:
                continue  # unverified drafts: hashed after rollback_rejected
            if s.num_new_tokens == 1 and request.num_computed_tokens % bs:
                continue  # a decode step that filled no block (the next full one catches up)
            self.blocks.cache_full_blocks(
                request.request_id, request.all_token_ids, request.num_computed_tokens,
                request.prefix_salt
            )


def _multi_token_last(s: ScheduledRequest) -> bool:
    """Sort key putting single-token queries first (decodes, then chunks: what backends expect)."""
    return s.num_new_tokens != 1
