"""The rejection sampler is lossless: emitted tokens follow the target distribution.

Reference: the target's own processed distribution (softmax of the logits after
temperature / top-k, as ``Sampler.process_logits`` gives it), tested with a chi-square
goodness-of-fit test on a 6-token vocabulary, whatever the drafts (point masses from a
different distribution, or drafts drawn from a q the sampler is told).
"""

from __future__ import annotations

import torch
from inference_engine.sampling.batch import SamplingBatch
from inference_engine.sampling.sampler import Sampler
from inference_engine.sampling_params import SamplingParams
from inference_engine.speculative.ngram import find_ngram_drafts
from inference_engine.speculative.rejection_sampler import RejectionSampler, VerifyRow

V = 6
# chi-square 0.999 quantile with V - 1 = 5 degrees of freedom: a false alarm 1 time in 1000.
CHI2_CRIT_DF5 = 20.52


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    batch = SamplingBatch.from_rows([params] * len(logits), [[]] * len(logits), vocab_size=V)
    return Sampler(seed=0).process_logits(logits, batch).softmax(-1)


def _run(num_trials: int, draft_probs: torch.Tensor | None, params: SamplingParams,
         logits: torch.Tensor) -> list[list[int]]:
    """Verify ``num_trials`` requests with 2 drafts each against the same 3 logit rows."""
    gen = torch.Generator().manual_seed(1)
    q = draft_probs if draft_probs is not None else torch.full((2, V), 1.0 / V)
    rows = []
    for _ in range(num_trials):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        rows.append(VerifyRow(params, [], [1], frozenset(), drafts,
                              None if draft_probs is None else draft_probs))
    sampler = RejectionSampler(Sampler(seed=3))
    out = sampler(logits.repeat(num_trials, 1), rows)
    return out.token_ids


def test_point_mass_drafts_keep_the_target_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    token_ids = _run(12000, None, params, logits)
    p = _target_probs(logits, params)
    first = torch.bincount(torch.tensor([t[0] for t in token_ids]), minlength=V).float()
    assert _chi2(first, p[0]) < CHI2_CRIT_DF5
    # The second token, where the first draft was accepted, follows the second row.
    seconds = [t[1] for t in token_ids if len(t) > 1]
    assert len(seconds) > 1000
    second = torch.bincount(torch.tensor(seconds), minlength=V).float()
    assert _chi2(second, p[1]) < CHI2_CRIT_DF5


def test_drafts_with_probabilities_keep_the_target_distribution():
    torch.manual_seed(1)
    logits = torch.randn(3, V) * 1.5
    # A drafter that disagrees with the target (but covers the vocabulary).
    q = torch.softmax(torch.randn(2, V), -1)
    params = SamplingParams(temperature=1.0)
    token_ids = _run(12000, q, params, logits)
    p = _target_probs(logits, params)
    first = torch.bincount(torch.tensor([t[0] for t in token_ids]), minlength=V).float()
    assert _chi2(first, p[0]) < CHI2_CRIT_DF5
    seconds = [t[1] for t in token_ids if len(t) > 1]
    second = torch.bincount(torch.tensor(seconds), minlength=V).float()
    assert _chi2(second, p[1]) < CHI2_CRIT_DF5
    # Acceptance of draft 1 is sum_x min(p, q): measured, within sampling error.
    expected = float(torch.minimum(p[0], q[0]).sum())
    accepted = sum(len(t) > 1 for t in token_ids) / len(token_ids)
    assert abs(accepted - expected) < 0.03


def test_greedy_accepts_while_draft_is_argmax_then_corrects():
    logits = torch.tensor([[0.0, 5.0, 0, 0, 0, 0],   # argmax 1
                           [0.0, 0, 5.0, 0, 0, 0],   # argmax 2
                           [0.0, 0, 0, 5.0, 0, 0]])  # argmax 3 (bonus)
    sampler = RejectionSampler(Sampler(seed=0))
    greedy = SamplingParams(temperature=0)
    out = sampler(torch.cat([logits, logits]), [
        VerifyRow(greedy, [], [0], frozenset(), [1, 2]),   # all accepted + bonus
        VerifyRow(greedy, [], [0], frozenset(), [1, 4]),   # second rejected, corrected
    ])
    assert out.token_ids == [[1, 2, 3], [1, 2]]
    assert out.num_accepted == [2, 1]


def test_seeded_rows_draw_what_the_plain_sampler_draws():
    """Draw j of a seeded request uses the seed and draw number len(outputs) + j, as the
    plain sampler does: the emitted tokens are the plain sampler's, draft or not."""
    torch.manual_seed(2)
    logits = torch.randn(4, V)
    params = SamplingParams(temperature=1.0, seed=11)
    plain = Sampler(seed=0)
    history: list[int] = [3, 4]
    expected = []
    for j in range(4):
        batch = SamplingBatch.from_rows([params], [history + expected], vocab_size=V)
        expected.append(int(plain.sample_tokens(logits[j : j + 1], batch)[0]))
    out = RejectionSampler(Sampler(seed=5))(
        logits, [VerifyRow(params, history, [1], frozenset(), expected[:3])])
    assert out.token_ids == [expected]


def test_penalties_apply_per_position_with_the_drafts_as_history():
    # A repetition penalty large enough to forbid a repeat: the row after draft "1" must
    # not pick 1 again although its raw argmax is 1.
    logits = torch.tensor([[0.0, 5.0, 0, 0, 0, 0], [0.0, 5.0, 4.0, 0, 0, 0]])
    params = SamplingParams(temperature=0, repetition_penalty=100.0)
    out = RejectionSampler(Sampler(seed=0))(
        logits, [VerifyRow(params, [], [0], frozenset(), [1])])
    assert out.token_ids == [[1, 2]]


def test_ngram_finds_the_longest_recurring_suffix():
    assert find_ngram_drafts([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 2, 3, 4) == [3, 4, 1, 2]
    assert find_ngram_drafts([1, 2, 3], 2, 3, 4) == []
    # A short period still drafts: the earliest occurrence has the most tokens after it.
    assert find_ngram_drafts([5, 6, 5, 6, 5, 6], 2, 2, 3) == [5, 6, 5]
    # The longest match wins over a shorter, later one.
    assert find_ngram_drafts([7, 8, 9, 1, 8, 9, 2, 7, 8, 9], 1, 3, 1) == [1]


def _ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule in plain Python: for n from the longest down, the occurrences of the last n
    tokens that end before the last token; the latest with k tokens after it, else the
    earliest."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        starts = [s for s in range(length - n) if tokens[s : s + n] == suffix]
        if starts and k > 0:
            full = [s for s in starts if s + n + k <= length]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start : start + k]
    return []


def test_ngram_matches_the_plain_python_rule_on_random_contexts():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randint(0, 30))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(0, 5)
        assert find_ngram_drafts(tokens, lo, hi, k) == _ngram_reference(tokens, lo, hi, k), (
            tokens, lo, hi, k)
