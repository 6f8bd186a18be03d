"""What the engine holds for speculative decoding: the proposer, the rejection sampler and
the acceptance counters (``/metrics``, bench output).

Per step the engine verifies each sampling request's drafts (:meth:`SpecDecoder.verify`),
appends the emitted tokens, rolls rejected slots back, then asks for the next drafts
(:meth:`SpecDecoder.propose`), which land in ``Request.spec_token_ids`` for the
scheduler to budget (1 + k tokens) next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from inference_engine.config import SpeculativeConfig
from inference_engine.interfaces.proposer import DraftRequest, Proposer, ProposerContext
from inference_engine.speculative.rejection_sampler import RejectionSampler, VerifyOutput, VerifyRow

if TYPE_CHECKING:
    from inference_engine.engine.request import Request
    from inference_engine.sampling.sampler import Sampler

__all__ = ["SpecDecodeMetrics", "SpecDecoder", "build_proposer"]


@dataclass
class SpecDecodeMetrics:
    """Counters over every verified request-step with at least one draft (vLLM's names)."""

    num_speculative_tokens: int
    # Request-steps that verified drafts.
    num_drafts: int = 0
    # Drafts verified, and drafts accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: request-steps whose draft at position j was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying request-step: 1 + accepted drafts (1.0 when none)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_pos]

    def as_stats(self) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            "spec_decode_acceptance_rate_per_pos": self.acceptance_rate_per_pos,
        }


def build_proposer(spec: SpeculativeConfig, context: ProposerContext,
                   registry: Any = None) -> Proposer:
    """The registered proposer named by ``spec.method``.

    Raises:
        UnknownNameError: no plugin registered that method (lists the registered ones).
    """
    if registry is None:
        from inference_engine.plugins import get_plugins

        registry = get_plugins().registry
    cls = registry.resolve("proposers", spec.method)
    return cls(spec, context)


class SpecDecoder:
    """The engine's speculative-decoding state."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self.metrics = SpecDecodeMetrics(self.num_speculative_tokens)
        self.rejection: RejectionSampler | None = None
        # request id -> [drafts, V] draft probabilities of its pending drafts (if any).
        self._draft_probs: dict[str, torch.Tensor] = {}

    def attach_sampler(self, sampler: Sampler) -> None:
        self.rejection = RejectionSampler(sampler)

    def on_target_step(self, request_ids: Sequence[str], num_computed: Sequence[int],
                       query_lens: Sequence[int]) -> None:
        self.proposer.on_target_step(request_ids, num_computed, query_lens)

    def verify(self, logits: torch.Tensor, requests: Sequence[Request],
               num_drafts: Sequence[int],
               token_bitmasks: Sequence[torch.Tensor | None] | None = None) -> VerifyOutput:
        """Verify each request's first ``num_drafts[i]`` drafts against ``logits``
        (``[sum(1 + num_drafts), V]``, request-major), each position masked by the
        request's grammar bits when it has some (``token_bitmasks``, from
        ``StructuredOutputManager.draft_bitmask``); records the acceptance counters."""
        rows = []
        masks = token_bitmasks or [None] * len(requests)
        for request, n, mask in zip(requests, num_drafts, masks, strict=True):
            probs = self._draft_probs.pop(request.request_id, None)
            rows.append(VerifyRow(
                request.params, request.output_token_ids, request.prompt_token_ids,
                request.eos_token_ids, request.spec_token_ids[:n],
                None if probs is None or n == 0 else probs[:n], mask))
        verdict = self.rejection(logits, rows)
        for n, accepted in zip(num_drafts, verdict.num_accepted, strict=True):
            self.metrics.record(n, accepted)
        return verdict

    def propose(self, requests: Sequence[Request], block_ids: Sequence[Sequence[int]],
                max_model_len: int) -> None:
        """Draft for ``requests`` (running, every token known) into ``spec_token_ids``."""
        asks = []
        for request, blocks in zip(requests, block_ids, strict=True):
            room = min(request.max_new_tokens() - len(request.output_token_ids) - 1,
                       max_model_len - request.num_tokens)
            asks.append(DraftRequest(request.request_id, request.all_token_ids, blocks,
                                     request.num_preemptions,
                                     max(0, min(self.num_speculative_tokens, room)),
                                     request.params, len(request.prompt_token_ids)))
        if not any(a.max_drafts for a in asks):
            return
        proposal = self.proposer.propose(asks)
        for i, (request, ask) in enumerate(zip(requests, asks, strict=True)):
            drafts = [int(t) for t in proposal.token_ids[i][: ask.max_drafts]]
            request.spec_token_ids = drafts
            probs = proposal.probs[i] if proposal.probs is not None else None
            if probs is not None and drafts:
                self._draft_probs[request.request_id] = probs[: len(drafts)]

    def remove(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        self.proposer.remove(request_id)
