"""``draft_sample_method: probabilistic``: drafts are draws from the q they report, and the
rejection sampler fed with them keeps the target distribution.

Reference: the target's processed distribution (``Sampler.process_logits`` softmax) and the
drafter's, checked with a chi-square goodness-of-fit test on a 6-token vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from inference_engine.config import SpeculativeConfig
from inference_engine.sampling.batch import SamplingBatch
from inference_engine.sampling.sampler import Sampler
from inference_engine.sampling_params import SamplingParams
from inference_engine.speculative.draft_sampling import DraftSampler
from inference_engine.speculative.rejection_sampler import RejectionSampler, VerifyRow

V = 6
# chi-square 0.999 quantile with 5 degrees of freedom.
CHI2_CRIT_DF5 = 20.52


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of zero probability was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    batch = SamplingBatch.from_rows([params] * len(logits), [[]] * len(logits), vocab_size=V)
    return Sampler(seed=0).process_logits(logits, batch).softmax(-1)


def test_probabilistic_drafts_follow_q_and_verification_keeps_the_target_distribution():
    torch.manual_seed(4)
    target_logits = torch.randn(2, V) * 1.5
    draft_logits = torch.randn(1, V) * 1.5          # a drafter that disagrees
    params = SamplingParams(temperature=0.8, top_k=5)
    num = 6000
    drafter = DraftSampler("probabilistic", seed=9)
    tokens, q = drafter.pick(draft_logits.repeat(num, 1), [params] * num, [[]] * num,
                             [[1]] * num)
    q_ref = _processed(draft_logits, params)[0]
    assert torch.allclose(q[0], q_ref, atol=1e-6)
    # The drafts are draws from the q they report (top-k 5 removes one token from it).
    assert _chi2(torch.bincount(torch.tensor(tokens), minlength=V).float(), q_ref) \
        < CHI2_CRIT_DF5
    rows = [VerifyRow(params, [], [1], frozenset(), [t], qi[None]) for t, qi in zip(tokens, q)]
    out = RejectionSampler(Sampler(seed=3))(target_logits.repeat(num, 1), rows)
    p = _processed(target_logits, params)
    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=V).float()
    assert _chi2(first, p[0]) < CHI2_CRIT_DF5
    # Acceptance is sum_x min(p, q), within sampling error.
    accepted = sum(n for n in out.num_accepted) / num
    assert abs(accepted - float(torch.minimum(p[0], q_ref).sum())) < 0.03


def test_greedy_requests_and_the_greedy_method_draft_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0], [2.0, 0, 1.0, 0, 0, 0]])
    sampled = SamplingParams(temperature=1.0, seed=1)
    tokens, q = DraftSampler("greedy").pick(logits, [sampled, sampled], [[], []], [[], []])
    assert (tokens, q) == ([1, 0], [None, None])
    tokens, q = DraftSampler("probabilistic").pick(
        logits, [SamplingParams(temperature=0), None], [[], []], [[], []])
    assert (tokens, q) == ([1, 0], [None, None])


def test_seeded_drafts_do_not_depend_on_the_batch():
    torch.manual_seed(5)
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(4)]
    histories = [[2], [3, 4], [], [5]]
    together, _ = DraftSampler("probabilistic", seed=1).pick(logits, params, histories,
                                                             [[0]] * 4)
    alone = [DraftSampler("probabilistic", seed=i + 7).pick(
        logits[i : i + 1], [params[i]], [histories[i]], [[0]])[0][0] for i in range(4)]
    assert together == alone


def test_bad_draft_sample_method_is_refused_by_name():
    with pytest.raises(ValueError, match="draft_sample_method"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "x",
                                     "num_speculative_tokens": 2,
                                     "draft_sample_method": "random"})
    with pytest.raises(ValueError, match="draft_sample_method"):
        DraftSampler("topk")
