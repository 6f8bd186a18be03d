"""Batched token selection with per-request parameters.

Processing order follows transformers' warpers: penalties, then temperature,
top-k, top-p, min-p, then a draw. Reported logprobs are the model's raw
distribution (log-softmax before any processing), as vLLM reports by default.

Seeded requests draw through their own ``torch.Generator`` (one exponential
vector per sampled token, ``argmax(p / E)`` — an exact categorical draw), so
their tokens depend only on their seed and their own history, never on what
else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inference_engine.engine.request import Request
from inference_engine.sampling.logprobs import Logprob, top_logprobs

__all__ = ["Sampler", "apply_penalties", "apply_top_k_top_p_min_p"]

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
                    repetition: float, presence: float, frequency: float) -> None:
    """In place on one row ``[vocab]``.

    Repetition (transformers' rule) covers prompt and output tokens: positive
    logits are divided, negative ones multiplied. Presence and frequency
    (OpenAI's rule) cover output tokens: ``logit -= presence * [count > 0] +
    frequency * count``.
    """
    vocab = logits.shape[0]
    if repetition != 1.0:
        seen = torch.tensor(list(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        if seen.numel():
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if (presence != 0.0 or frequency != 0.0) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=logits.device),
                                minlength=vocab)[:vocab].to(logits.dtype)
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask ``[rows, vocab]`` logits per row; ``top_k`` 0 = off, ``top_p`` 1 = off, ``min_p`` 0 = off.

    One descending sort serves top-k and top-p; top-p is taken over the
    distribution left after top-k, and min-p over what is left after both.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, NEG_INF)
    probs = sorted_logits.softmax(dim=1)
    # Drop a token once the more likely ones already hold top_p of the mass.
    exclusive = probs.cumsum(dim=1) - probs
    drop = (exclusive >= top_p[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    if bool((min_p > 0).any()):
        probs = sorted_logits.softmax(dim=1)
        sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Picks one token per row of logits for the requests that sample this step."""

    def __init__(self, seed: int | None = None, tokenizer: Any = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else torch.initial_seed())
        self.tokenizer = tokenizer

    @staticmethod
    def _request_generator(request: Request) -> torch.Generator:
        gen = request.extra.get("generator")
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(int(request.params.seed))
            request.extra["generator"] = gen
        return gen

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]
               ) -> tuple[list[int], list[dict[int, Logprob]] | None]:
        """Token ids (and logprobs where requested) for ``logits [rows, vocab]`` float32."""
        params = [r.params for r in requests]
        want_logprobs = [p.logprobs for p in params]
        any_logprobs = any(n is not None for n in want_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any_logprobs else None
        blocked = [
            i for i, r in enumerate(requests)
            if len(r.output_token_ids) < r.params.min_tokens and r.eos_token_ids
        ]
        special = blocked or any(p.has_penalties for p in params)
        if not special and all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = self._sample_general(logits.clone(), requests, blocked)
        if not any_logprobs:
            return tokens, None
        rows = [i for i, n in enumerate(want_logprobs) if n is not None]
        picked = top_logprobs(raw_logprobs[rows], [tokens[i] for i in rows],
                              [want_logprobs[i] for i in rows], self.tokenizer)
        result: list[dict[int, Logprob]] = [{} for _ in requests]
        for i, entry in zip(rows, picked, strict=True):
            result[i] = entry
        return tokens, result

    def _sample_general(self, logits: torch.Tensor, requests: Sequence[Request],
                        blocked: list[int]) -> list[int]:
        for i in blocked:
            logits[i, list(requests[i].eos_token_ids)] = NEG_INF
        for i, r in enumerate(requests):
            p = r.params
            if p.has_penalties:
                apply_penalties(logits[i], r.prompt_token_ids, r.output_token_ids,
                                p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        greedy = [r.params.greedy for r in requests]
        tokens = logits.argmax(dim=-1).tolist()
        rows = [i for i, g in enumerate(greedy) if not g]
        if not rows:
            return tokens
        sub = logits[rows]
        ps = [requests[i].params for i in rows]
        temps = torch.tensor([p.temperature for p in ps], dtype=sub.dtype)
        sub = sub / temps[:, None]
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in ps], dtype=sub.dtype)
        min_p = torch.tensor([p.min_p for p in ps], dtype=sub.dtype)
        if bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()):
            sub = apply_top_k_top_p_min_p(sub, top_k, top_p, min_p)
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(rows) if requests[i].params.seed is not None]
        if len(seeded) < len(rows):
            noise.exponential_(generator=self.generator)
        for j in seeded:
            noise[j].exponential_(generator=self._request_generator(requests[rows[j]]))
        drawn = (probs / noise).argmax(dim=-1).tolist()
        for j, i in enumerate(rows):
            tokens[i] = drawn[j]
        return tokens
