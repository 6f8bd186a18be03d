"""Logprob records (vLLM's shape): raw model log-probabilities, ranks, top-N."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Logprob", "prompt_logprobs", "top_logprobs"]


@dataclass(slots=True)
class Logprob:
    logprob: float
    # 1-based position in the model's distribution (1 = most likely).
    rank: int
    decoded_token: str | None = None


def _decode(tokenizer: Any, token: int) -> str | None:
    if tokenizer is None:
        return None
    return tokenizer.decode([token])


def top_logprobs(
    logprobs: torch.Tensor, chosen: list[int], num: list[int], tokenizer: Any = None
) -> list[dict[int, Logprob]]:
    """Per row: the chosen token and the row's top-``num[i]`` as ``{token: Logprob}``.

    ``logprobs`` is ``[rows, vocab]`` log-softmax of the raw logits.
    """
    rows = logprobs.shape[0]
    chosen_t = torch.tensor(chosen, dtype=torch.long, device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen_t[:, None]).squeeze(1)
    ranks = (logprobs > chosen_lp[:, None]).sum(1) + 1
    k = max(num) if num else 0
    top_v, top_i = (logprobs.topk(k, dim=1) if k else (None, None))
    out = []
    chosen_lp_l, ranks_l = chosen_lp.tolist(), ranks.tolist()
    top_v_l = top_v.tolist() if k else None
    top_i_l = top_i.tolist() if k else None
    for r in range(rows):
        entry = {chosen[r]: Logprob(chosen_lp_l[r], ranks_l[r], _decode(tokenizer, chosen[r]))}
        for j in range(num[r]):
            token = top_i_l[r][j]
            if token not in entry:
                entry[token] = Logprob(top_v_l[r][j], j + 1, _decode(tokenizer, token))
        out.append(entry)
    return out


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], num: int, tokenizer: Any = None
) -> list[dict[int, Logprob]]:
    """Row ``j`` of ``logits`` predicts ``targets[j]``: its logprob, rank and top-``num``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return top_logprobs(lp, targets, [num] * len(targets), tokenizer)
