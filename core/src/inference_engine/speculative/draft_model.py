"""Draft-model proposer: a small causal LM of the target's vocabulary drafts k tokens greedily.

The drafter has its own paged KV pool with the target's geometry (block size and
block count), indexed by the *target's* block ids: a request's blocks hold the
target's K/V in the target pool and the drafter's K/V in the drafter pool, so the
block manager, preemption and the lookahead slots the scheduler reserves
(``num_lookahead_slots = k``) serve both. Per step the drafter first catches up on the
tokens it has not seen (the whole prompt the first time, then the accepted tokens:
one batched forward), then runs k - 1 single-token forwards. Drafts beyond the
verified tokens are written into lookahead slots and overwritten later, exactly as
rejected target slots are.

Drafting is greedy by default (vLLM's default ``draft_sample_method``), so the drafts are
a point mass for the rejection sampler; ``draft_sample_method: probabilistic`` draws them
with each request's sampling parameters and passes their probabilities q
(:mod:`inference_engine.speculative.draft_sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_engine.config import ModelConfig, QuantConfig, SpeculativeConfig
from inference_engine.engine.model_runner import ModelRunner, StepBatch
from inference_engine.interfaces.attention import KVCacheSpec
from inference_engine.interfaces.proposer import DraftRequest, Proposal, Proposer, ProposerContext
from inference_engine.speculative.draft_sampling import DraftSampler

__all__ = ["DraftModelProposer"]


class DraftModelProposer(Proposer):
    """``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``.

    Raises:
        ValueError: no ``model``, or a drafter whose vocabulary or context is smaller than
            the target's (named).
    """

    supports_probabilistic_drafts = True

    def __init__(self, spec: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(spec, context)
        self.draft_sampler = DraftSampler(spec.draft_sample_method, context.config.model.seed)
        if not spec.model:
            raise ValueError("speculative_config 'model' is required for method draft_model "
                             "(the drafter's folder)")
        from inference_engine.engine.loader import load_model

        target = context.config.model
        dtype = spec.draft_dtype or {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                     torch.float16: "float16"}.get(context.dtype, "auto")
        model_config = ModelConfig(model=spec.model, dtype=dtype,
                                   max_model_len=context.max_model_len,
                                   attention_backend=target.attention_backend,
                                   kv_cache_dtype=target.kv_cache_dtype, seed=target.seed)
        loaded = load_model(model_config, QuantConfig(), context.platform, show_progress=False)
        vocab = loaded.model.ctx.hf_config.vocab_size
        if vocab != context.vocab_size:
            raise ValueError(f"speculative_config 'model' {spec.model!r} has a vocabulary of "
                             f"{vocab} tokens; the target's has {context.vocab_size} (they must "
                             f"match)")
        self.model = loaded.model
        sched = context.config.scheduler
        self.max_num_seqs = int(sched.max_num_seqs or 1)
        # A catch-up forward takes at most this many tokens (longer ones are split).
        self.max_step_tokens = max(sched.max_num_batched_tokens, context.block_size)
        self.runner = ModelRunner(self.model, context.platform, context.block_size,
                                  context.max_model_len, self.max_num_seqs,
                                  self.max_step_tokens, enforce_eager=True)
        # request id -> (tokens whose drafter K/V are in the pool, preemptions seen then).
        self._computed: dict[str, tuple[int, int]] = {}

    @property
    def num_lookahead_slots(self) -> int:
        return self.num_speculative_tokens

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.runner.kv_cache_specs()

    def bind_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def remove(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        # Per request, the draft distributions q (probabilistic drafting only).
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_drafts > 0]
        if not active:
            return Proposal(drafts)
        first, first_q = self._catch_up([requests[i] for i in active])
        for i, token, q in zip(active, first, first_q, strict=True):
            drafts[i].append(token)
            if q is not None:
                probs[i].append(q)
        for step in range(1, self.num_speculative_tokens):
            rows = [i for i in active if len(drafts[i]) <= step < requests[i].max_drafts]
            for start in range(0, len(rows), self.max_num_seqs):
                chunk = rows[start : start + self.max_num_seqs]
                batch = StepBatch(
                    token_ids=[list(requests[i].token_ids) + drafts[i] for i in chunk],
                    num_computed=[len(requests[i].token_ids) + step - 1 for i in chunk],
                    query_lens=[1] * len(chunk),
                    block_lists=[requests[i].block_ids for i in chunk],
                    sample_rows=list(range(len(chunk))), prompt_rows=[])
                picked, q = self._pick(self.runner.execute_batch(batch).sample_logits,
                                       [requests[i] for i in chunk], [drafts[i] for i in chunk])
                for i, token, qi in zip(chunk, picked, q, strict=True):
                    drafts[i].append(int(token))
                    if qi is not None:
                        probs[i].append(qi)
        if not any(probs):
            return Proposal(drafts)
        return Proposal(drafts, [torch.stack(p) if p else None for p in probs])

    def _pick(self, logits: torch.Tensor, requests: Sequence[DraftRequest],
              drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[torch.Tensor | None]]:
        """The next draft of each row (``drafts``: each request's drafts so far)."""
        return self.draft_sampler.pick(
            logits, [r.params for r in requests],
            [list(r.token_ids[r.num_prompt_tokens:]) + list(d)
             for r, d in zip(requests, drafts, strict=True)],
            [r.token_ids[:r.num_prompt_tokens] for r in requests])

    def _catch_up(self, requests: Sequence[DraftRequest]
                  ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Feed each request's tokens the drafter has not cached; returns each one's first
        draft (picked after its last verified token) and its q (None: a point mass)."""
        done: list[int | None] = [None] * len(requests)
        done_q: list[torch.Tensor | None] = [None] * len(requests)
        start = []
        for r in requests:
            seen, preemptions = self._computed.get(r.request_id, (0, r.num_preemptions))
            # A preempted request recomputes from zero (its blocks were freed).
            start.append(seen if preemptions == r.num_preemptions else 0)
        pending = list(range(len(requests)))
        while pending:
            rows, lens, budget = [], [], self.max_step_tokens
            for i in pending:
                if budget <= 0 or len(rows) == self.max_num_seqs:
                    break
                n = min(len(requests[i].token_ids) - start[i], budget)
                rows.append(i)
                lens.append(n)
                budget -= n
            # Single-token queries first, as attention backends expect.
            order = sorted(range(len(rows)), key=lambda j: lens[j] != 1)
            rows, lens = [rows[j] for j in order], [lens[j] for j in order]
            samples = [j for j, i in enumerate(rows)
                       if start[i] + lens[j] == len(requests[i].token_ids)]
            batch = StepBatch(
                token_ids=[requests[i].token_ids for i in rows],
                num_computed=[start[i] for i in rows], query_lens=lens,
                block_lists=[requests[i].block_ids for i in rows],
                sample_rows=samples, prompt_rows=[])
            logits = self.runner.execute_batch(batch).sample_logits
            picked, q = (self._pick(logits, [requests[rows[j]] for j in samples],
                                    [()] * len(samples)) if samples else ([], []))
            for j, token, qj in zip(samples, picked, q, strict=True):
                done[rows[j]] = int(token)
                done_q[rows[j]] = qj
            for j, i in enumerate(rows):
                start[i] += lens[j]
            pending = [i for i in pending if done[i] is None]
        for r in requests:
            self._computed[r.request_id] = (len(r.token_ids), r.num_preemptions)
        return [int(t) for t in done], done_q  # type: ignore[arg-type]
