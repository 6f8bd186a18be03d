"""Logprob records in vLLM's shape: raw model log-probabilities, ranks, top-N.

A position's logprobs are ``dict[int, Logprob]``: the chosen (sampled or
prompt) token first, then the top-N tokens not already in it. Ranks are
1-based over the raw distribution: the chosen token's rank is one plus the
number of tokens strictly more likely; a top-N entry's rank is its place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Logprob",
    "TokenDecoder",
    "compute_prompt_logprobs",
    "logprobs_to_dicts",
    "prompt_logprobs",
    "top_logprobs",
]


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position."""

    # Natural-log probability under the model's raw distribution.
    logprob: float
    # 1-based position in that distribution (1 = most likely).
    rank: int
    # The token alone, decoded; None without a tokenizer.
    decoded_token: str | None = None


class TokenDecoder:
    """Decodes single tokens for ``Logprob.decoded_token``, caching each id once."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def logprobs_to_dicts(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    num_logprobs: Sequence[int],
    decoder: TokenDecoder | None = None,
) -> list[dict[int, Logprob]]:
    """Per row: the chosen token and the row's top-``num_logprobs[i]``.

    Args:
        logprobs: ``[R, V]`` log-softmax of the raw logits.
        token_ids: ``[R]`` int64, the chosen token of each row.
        num_logprobs: per row, how many top entries (0 = only the chosen one, -1 = all).
        decoder: fills ``decoded_token``; None leaves it None.
    """
    decoder = decoder or TokenDecoder(None)
    vocab = logprobs.shape[1]
    # -1 asks for the whole vocabulary (vLLM's convention).
    num_logprobs = [vocab if n == -1 else n for n in num_logprobs]
    token_ids = token_ids.to(logprobs.device, torch.int64)
    # chosen: [R], ranks: [R]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=1) + 1
    max_n = min(max(num_logprobs, default=0), vocab)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_n:
        top = logprobs.topk(max_n, dim=1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for r, (token, value, rank) in enumerate(
        zip(token_ids.tolist(), chosen.tolist(), ranks.tolist(), strict=True)
    ):
        entry = {token: Logprob(value, rank, decoder(token))}
        for j in range(min(num_logprobs[r], max_n)):
            top_token = top_ids[r][j]
            if top_token not in entry:
                entry[top_token] = Logprob(top_values[r][j], j + 1, decoder(top_token))
        out.append(entry)
    return out


def top_logprobs(
    logprobs: torch.Tensor, chosen: list[int], num: list[int], tokenizer: Any = None
) -> list[dict[int, Logprob]]:
    """List-in form of :func:`logprobs_to_dicts` (``logprobs`` is ``[R, V]`` log-softmax)."""
    ids = torch.tensor(chosen, dtype=torch.int64, device=logprobs.device)
    return logprobs_to_dicts(logprobs, ids, num, TokenDecoder(tokenizer))


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], num: int, tokenizer: Any = None
) -> list[dict[int, Logprob]]:
    """Row ``j`` of ``logits [len(targets), V]`` predicts ``targets[j]``: its entry and top-``num``.

    For prompts arriving in chunks; see :func:`compute_prompt_logprobs` for a whole prompt.
    """
    lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    return top_logprobs(lp, targets, [num] * len(targets), tokenizer)


def compute_prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: Sequence[int], num_logprobs: int,
    tokenizer: Any = None,
) -> list[dict[int, Logprob] | None]:
    """Prompt logprobs of a whole prompt, vLLM's shape (the first position is None).

    Args:
        logits: ``[P, V]`` (or ``[P - 1, V]``): row ``j`` is the model's output at
            prompt position ``j``, predicting token ``j + 1``; a last row (which
            predicts the first generated token) is ignored.
        prompt_token_ids: the ``P`` prompt tokens.
        num_logprobs: top-N per position (0 = only the prompt token).
        tokenizer: fills ``decoded_token`` when given.

    Returns:
        ``P`` entries: None, then one dict per prompt token after the first.
    """
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        return []
    if logits.shape[0] < num_prompt - 1:
        raise ValueError(
            f"need at least {num_prompt - 1} rows of logits for {num_prompt} prompt tokens, "
            f"got {logits.shape[0]}"
        )
    first: list[dict[int, Logprob] | None] = [None]
    if num_prompt == 1:
        return first
    return first + prompt_logprobs(logits[: num_prompt - 1], list(prompt_token_ids[1:]),
                                   num_logprobs, tokenizer)
