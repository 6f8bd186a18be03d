"""How a model drafter picks its tokens: ``draft_sample_method`` (vLLM's key).

* ``greedy`` (default): the drafter's argmax, a point mass for the rejection sampler.
* ``probabilistic``: a draw from the drafter's distribution q after the request's own
  sampling parameters (penalties, temperature, top-k, top-p, min-p), with q passed to the
  rejection sampler, which accepts with ``min(1, p/q)`` and draws rejections from
  ``norm(max(p - q, 0))``. Lossless for any q as long as the draft is a draw from that q,
  which is why the draw and q come from one processed tensor here. Greedy requests still
  draft greedily (their verification ignores q). A seeded request draws its draft number j
  from its seed, its output count and j (salted apart from the target's and the rejection
  sampler's streams), so its outputs do not depend on the batch it runs in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from inference_engine.sampling.batch import SamplingBatch
from inference_engine.sampling.sampler import Sampler, greedy_pick
from inference_engine.sampling_params import SamplingParams

__all__ = ["DRAFT_SAMPLE_METHODS", "DraftSampler"]

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# Keeps a seeded request's draft draws apart from its target draws.
_DRAFT_SALT = 0xD2AF7


class DraftSampler:
    """Picks drafts from a drafter's logits and, when probabilistic, returns q.

    Args:
        method: one of :data:`DRAFT_SAMPLE_METHODS`.
        seed: seed of the stream unseeded requests' drafts are drawn from.
    """

    def __init__(self, method: str, seed: int | None = None) -> None:
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config 'draft_sample_method' must be one of "
                             f"{list(DRAFT_SAMPLE_METHODS)}, got {method!r}")
        self.is_probabilistic = method == "probabilistic"
        self.sampler = Sampler(None if seed is None else seed ^ _DRAFT_SALT)
        # id(request params) -> (those params, their copy with the salted seed)
        self._salted: dict[int, tuple[SamplingParams, SamplingParams]] = {}

    def pick(self, logits: torch.Tensor, params: Sequence[SamplingParams | None],
             histories: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]]
             ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Drafts for ``logits [B, V]`` (one row per request).

        Args:
            params: per row, the request's sampling parameters (None: greedy).
            histories: per row, its outputs so far followed by the drafts before this one
                (the draw number and the penalties' history).
            prompts: per row, its prompt (repetition penalty).

        Returns:
            ``(token ids [B], q)``: q per row a float32 ``[V]`` distribution the token was
            drawn from, or None where the draft is the argmax (a point mass).
        """
        rows = [i for i, p in enumerate(params)
                if self.is_probabilistic and p is not None and not p.is_greedy]
        if not rows:
            return greedy_pick(logits).tolist(), [None] * len(params)
        tokens = greedy_pick(logits).tolist() if len(rows) < len(params) else [0] * len(params)
        q: list[torch.Tensor | None] = [None] * len(params)
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        batch = SamplingBatch.from_rows([self._salted_params(params[i]) for i in rows],
                                        [histories[i] for i in rows],
                                        vocab_size=logits.shape[1], device=logits.device,
                                        prompt_token_ids=[prompts[i] for i in rows])
        sub = logits.index_select(0, index).float()
        # One processed tensor gives both the draw and q, so the draft is a draw from q.
        probs = self.sampler.process_logits(sub, batch).softmax(dim=-1)
        drawn = self.sampler._draw(probs.clone(), batch).tolist()
        for j, i in enumerate(rows):
            tokens[i] = int(drawn[j])
            q[i] = probs[j]
        return tokens, q

    def _salted_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its seed salted (the same object when unseeded)."""
        if params.seed is None:
            return params
        hit = self._salted.get(id(params))
        if hit is None or hit[0] is not params:
            if len(self._salted) > 4096:
                self._salted.clear()
            hit = self._salted[id(params)] = (
                params, dataclasses.replace(params, seed=params.seed ^ _DRAFT_SALT))
        return hit[1]
