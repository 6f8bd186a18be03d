"""Batched logits processors with one parameter per row.

Each follows the transformers warper of the same name (the tests compare them
row by row): ties at the top-k boundary are kept, top-p keeps the token that
crosses the threshold, top-p and min-p always keep at least one token.
Inputs are float32 ``[rows, vocab]``; the ``*_`` functions work in place.
"""

from __future__ import annotations

import torch

__all__ = [
    "apply_min_p",
    "apply_penalties_",
    "apply_temperature_",
    "apply_top_k",
    "apply_top_k_top_p",
    "apply_top_k_top_p_min_p",
]

NEG_INF = float("-inf")


def apply_penalties_(
    logits: torch.Tensor,
    seen_mask: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition, then presence and frequency penalties, in place.

    Args:
        logits: ``[rows, vocab]`` float32.
        seen_mask: ``[rows, vocab]`` bool, tokens in the row's prompt or output.
        repetition_penalty: ``[rows]``; transformers' rule on seen tokens:
            positive logits are divided by it, negative ones multiplied. 1 = off.
        output_counts: ``[rows, vocab]`` float32, occurrences in the row's output.
        presence_penalty: ``[rows]``; OpenAI's ``- presence * [count > 0]``.
        frequency_penalty: ``[rows]``; OpenAI's ``- frequency * count``.

    Returns:
        ``logits``.
    """
    if seen_mask is not None and repetition_penalty is not None:
        penalty = repetition_penalty[:, None]
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        torch.where(seen_mask, penalised, logits, out=logits)
    if output_counts is not None:
        if frequency_penalty is not None:
            logits.sub_(frequency_penalty[:, None] * output_counts)
        if presence_penalty is not None:
            logits.sub_(presence_penalty[:, None] * (output_counts > 0))
    return logits


def apply_temperature_(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature ``[rows]`` (greedy rows should carry 1.0)."""
    return logits.div_(temperature[:, None])


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None
                ) -> torch.Tensor:
    """Keep each row's ``top_k[i]`` best logits (and ties); ``top_k >= vocab`` or 0 = off.

    Uses ``topk`` with the largest k in the batch instead of a full sort.

    Args:
        logits: ``[rows, vocab]``.
        top_k: ``[rows]`` int64.
        max_k: a host-side bound on the rows' active k (the batch knows it before
            the step); None: the vocabulary, so nothing is read back from ``top_k``.
    """
    vocab = logits.shape[1]
    is_on = (top_k > 0) & (top_k < vocab)
    k = torch.where(is_on, top_k, 1)
    # NOTE: any max_k >= every active k picks the same k-th values; it is only the topk width.
    max_k = vocab if max_k is None else max(1, min(int(max_k), vocab))
    # kth: [rows, 1], the k-th largest logit of each row.
    kth = logits.topk(max_k, dim=1).values.gather(1, (k - 1)[:, None])
    kth = kth.masked_fill(~is_on[:, None], NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p with one ascending sort (vLLM's layout of transformers' rule).

    Args:
        logits: ``[rows, vocab]``.
        top_k: ``[rows]`` int64, 0 or >= vocab = off; or None for no row.
        top_p: ``[rows]``, 1 = off. Taken over the distribution left by top-k.
    """
    vocab = logits.shape[1]
    # sorted_logits, order: [rows, vocab], ascending.
    sorted_logits, order = logits.sort(dim=1, descending=False)
    if top_k is not None:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        kth = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, NEG_INF)
    cumulative = sorted_logits.softmax(dim=1).cumsum_(dim=1)
    drop = (cumulative <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability below ``min_p[i]`` times the row's top probability."""
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Top-k, top-p, min-p in that order; a None argument means off for every row.

    Sorts only when some row uses top-p; top-k alone uses ``topk`` of width
    ``max_top_k`` (see :func:`apply_top_k`). Reads nothing back to the host.
    """
    if top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    elif top_k is not None:
        logits = apply_top_k(logits, top_k, max_top_k)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return logits


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token whose bit is clear, in place (xgrammar's packed layout).

    One batched op over all rows, no host sync: bit ``j % 32`` of ``bitmask[:, j // 32]``
    says whether token ``j`` is allowed.

    Args:
        logits: ``[rows, vocab]`` float.
        bitmask: ``[rows, ceil(vocab / 32)]`` int32.
    """
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # bits: [rows, words * 32] bool, allowed tokens.
    bits = ((bitmask[:, :, None] >> shifts) & 1).to(torch.bool).reshape(rows, -1)
    return logits.masked_fill_(~bits[:, :vocab], NEG_INF)
