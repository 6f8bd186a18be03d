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
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Candidate starts 0..length-n-1 (the suffix itself, at length-n, is excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            # The latest occurrence followed by k tokens (recent context predicts best), or
            # failing that the earliest (the most tokens follow it: a short period repeats).
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt-lookup drafting; ``prompt_lookup_min/max`` from the speculative config."""

    def propose(self, requests: Sequence[DraftRequest]) -> Proposal:
        lo = self.spec.prompt_lookup_min or 5
        hi = self.spec.prompt_lookup_max or lo
        return Proposal([find_ngram_drafts(r.token_ids, lo, hi, r.max_drafts)
                         for r in requests])
