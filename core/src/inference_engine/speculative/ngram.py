"""n-gram (prompt lookup) proposer: drafts what followed the context's last n-gram before.

vLLM's ``ngram`` method: the longest suffix of the context with a length in
``[prompt_lookup_min, prompt_lookup_max]`` that occurred earlier in prompt + output
proposes the (up to k) tokens that followed its latest earlier occurrence with k tokens
after it (else its earliest, so a short period still drafts k). No
model, no cache; the drafts are a point mass (no probabilities).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference_engine.interfaces.proposer import DraftRequest, Proposal, Proposer

__all__ = ["NgramProposer", "find_ngram_drafts"]


def find_ngram_drafts(token_ids: Sequence[int] | np.ndarray, min_n: int, max_n: int,
                      k: int) -> list[int]:
    """The tokens after an earlier occurrence of the longest matching suffix.

    Args:
        token_ids: the context (prompt + outputs).
        min_n, max_n: the suffix lengths tried, longest first.
        k: most tokens returned.

    Returns:
        Up to ``k`` token ids; empty when no suffix of ``min_n`` tokens recurs.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if k <= 0 or max_n < min_n or min_n < 1:
        return []
    # Candidate occurrence ends: earlier positions (not the last) holding the last token.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    if not len(ends):
        return []
    # How far back each candidate matches the suffix (capped at max_n): one comparison
    # per candidate and suffix position, instead of a window scan per suffix length.
    match = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        back = ends - j
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[length - 1 - j]
        if not alive.any():
            break
        match += alive
    n = int(match.max())
    if n < min_n:
        return []
    # Occurrences of the longest suffix, by start: the latest followed by k tokens (recent
    # context predicts best), or failing that the earliest (the most tokens follow it: a
    # short period repeats).
    starts = ends[match >= n] - n + 1
    full = starts[starts + n + k <= length]
    start = int(full[-1] if len(full) else starts[0]) + n
    return tokens[start : start + k].tolist()


class NgramProposer(Proposer):
    """Prompt-lookup drafting; ``prompt_lookup_min/max`` from the speculative config."""

    def propose(self, requests: Sequence[DraftRequest]) -> Proposal:
        lo = self.spec.prompt_lookup_min or 5
        hi = self.spec.prompt_lookup_max or lo
        return Proposal([find_ngram_drafts(r.token_ids, lo, hi, r.max_drafts)
                         for r in requests])
