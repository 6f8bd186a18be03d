"""Sampler: logits processing against transformers' processors, draws, seeds, fast path."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from inference_engine.sampling import Sampler, SamplingBatch
from inference_engine.sampling.processors import apply_top_k_top_p_min_p
from inference_engine.sampling_params import SamplingParams

VOCAB = 64


def make_batch(params, outputs=None, prompts=None, vocab=VOCAB, eos=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingBatch.from_rows(params, outputs, vocab, prompt_token_ids=prompts,
                                   eos_token_ids=eos)


def hf_process(row_logits, p: SamplingParams, prompt, output):
    """One row through transformers' processors (plus OpenAI's presence/frequency)."""
    scores = row_logits[None].clone()
    input_ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long)
    if p.repetition_penalty != 1.0 and input_ids.numel():
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    counts = Counter(output)
    for token, count in counts.items():
        scores[0, token] -= p.frequency_penalty * count + p.presence_penalty
    if p.is_greedy:
        return scores[0]
    scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(input_ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(input_ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(input_ids, scores)
    return scores[0]


def assert_same_logits(ours, ref):
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-5, atol=1e-5)


MIXED_PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.8, temperature=1.3),
    SamplingParams(min_p=0.1),
    SamplingParams(top_k=10, top_p=0.6, min_p=0.05, temperature=0.5),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(repetition_penalty=0.7, top_p=0.9),
    SamplingParams(presence_penalty=0.8, frequency_penalty=0.3, top_k=20),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(top_k=1),
    SamplingParams(top_k=VOCAB + 5, top_p=0.99),
]


@pytest.mark.parametrize("trial", range(4))
def test_processed_logits_match_transformers_row_by_row(trial):
    gen = torch.Generator().manual_seed(trial)
    logits = torch.randn(len(MIXED_PARAMS), VOCAB, generator=gen) * 3
    prompts = [torch.randint(0, VOCAB, (7,), generator=gen).tolist() for _ in MIXED_PARAMS]
    outputs = [torch.randint(0, VOCAB, (i % 5,), generator=gen).tolist()
               for i in range(len(MIXED_PARAMS))]
    batch = make_batch(MIXED_PARAMS, outputs, prompts)
    ours = Sampler(seed=0).process_logits(logits, batch)
    for i, p in enumerate(MIXED_PARAMS):
        assert_same_logits(ours[i], hf_process(logits[i], p, prompts[i], outputs[i]))


@pytest.mark.parametrize("top_k, top_p, min_p", [(3, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.2),
                                                 (7, 0.9, 0.0), (4, 0.7, 0.3)])
def test_warpers_keep_ties_like_transformers(top_k, top_p, min_p):
    # Coarse logits so many values tie at the top-k boundary.
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randint(-3, 3, (6, 32), generator=gen).float()
    n = logits.shape[0]
    ours = apply_top_k_top_p_min_p(
        logits.clone(),
        torch.full((n,), top_k) if top_k else None,
        torch.full((n,), top_p) if top_p < 1 else None,
        torch.full((n,), min_p) if min_p else None,
    )
    ref = logits.clone()
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    if min_p:
        ref = MinPLogitsWarper(min_p)(None, ref)
    # Which of several tied tokens top-p drops depends on sort order; what is kept must not.
    for row_ours, row_ref in zip(ours, ref, strict=True):
        assert torch.equal(row_ours[~row_ours.isinf()].sort().values,
                           row_ref[~row_ref.isinf()].sort().values)
    if top_p == 1.0:
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))


def test_presence_and_frequency_follow_openai_formula():
    logits = torch.randn(1, VOCAB)
    output = [3, 3, 3, 7, 9, 9]
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    ours = Sampler().process_logits(logits, make_batch([p], [output]))
    expected = logits[0].clone()
    for token in range(VOCAB):
        count = output.count(token)
        expected[token] -= count * 0.25 + (1.0 if count > 0 else 0.0) * 0.5
    torch.testing.assert_close(ours[0], expected)


def test_repetition_penalty_covers_prompt_and_output_but_presence_only_output():
    logits = torch.full((1, VOCAB), 2.0)
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)
    ours = Sampler().process_logits(logits, make_batch([p], outputs=[[5]], prompts=[[4]]))
    assert ours[0, 4].item() == 1.0  # prompt token: repetition only
    assert ours[0, 5].item() == 0.0  # output token: 2 / 2 - 1
    assert ours[0, 6].item() == 2.0


def test_input_logits_are_not_modified():
    logits = torch.randn(len(MIXED_PARAMS), VOCAB)
    before = logits.clone()
    batch = make_batch(MIXED_PARAMS, [[1, 2]] * len(MIXED_PARAMS), [[3]] * len(MIXED_PARAMS))
    Sampler(seed=1)(logits, batch)
    assert torch.equal(logits, before)


def test_plain_greedy_batch_is_argmax_without_reading_histories():
    class Untouchable(list):
        def __getitem__(self, index):
            raise AssertionError("histories must not be read on the greedy fast path")

    params = [SamplingParams(temperature=0.0) for _ in range(8)]
    batch = SamplingBatch.from_rows(params, Untouchable(), 1000, prompt_token_ids=Untouchable())
    assert batch.is_plain_greedy
    logits = torch.randn(8, 1000)
    out = Sampler()(logits, batch)
    assert out.logprobs is None
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_greedy_rows_in_a_mixed_batch_take_argmax_after_penalties():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen)
    best = logits[1].argmax().item()
    params = [SamplingParams(), SamplingParams(temperature=0.0, repetition_penalty=5.0),
              SamplingParams(temperature=0.0), SamplingParams(top_k=3)]
    batch = make_batch(params, outputs=[[], [best], [], []])
    tokens = Sampler(seed=0)(logits, batch).sampled_token_ids
    penalised = logits[1].clone()
    penalised[best] = penalised[best] / 5.0 if penalised[best] > 0 else penalised[best] * 5.0
    assert tokens[1].item() == penalised.argmax().item() != best
    assert tokens[2].item() == logits[2].argmax().item()
    assert tokens[3].item() in logits[3].topk(3).indices.tolist()


def test_min_tokens_blocks_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 10.0  # EOS
    logits[:, 1] = 9.0  # a stop token id
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    eos = [{0, 1}, {0, 1}]
    early = make_batch([p, p], outputs=[[5], [5, 5]], eos=eos)
    assert Sampler()(logits, early).sampled_token_ids.tolist() == [2, 2]
    done = make_batch([p, p], outputs=[[5, 5, 5], [5, 5]], eos=eos)
    assert Sampler()(logits, done).sampled_token_ids.tolist() == [0, 2]


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
    # Neighbours' top-p/top-k/min-p/penalties switch code paths this row does not use.
    SamplingParams(seed=77),
])
def test_seeded_row_ignores_batch_composition_and_position(target):
    others = [SamplingParams(top_p=0.5, repetition_penalty=1.3), SamplingParams(temperature=0.0),
              SamplingParams(seed=99, top_k=4, presence_penalty=0.5),
              SamplingParams(temperature=1.5, min_p=0.05)]
    gen = torch.Generator().manual_seed(0)
    history: list[int] = []
    alone_tokens, positions_tokens = [], {0: [], 2: [], 4: []}
    for _step in range(25):
        row_logits = torch.randn(VOCAB, generator=gen)
        alone = Sampler(seed=1)(row_logits[None], make_batch([target], [history]))
        alone_tokens.append(alone.sampled_token_ids.item())
        for pos in positions_tokens:
            params = others[:pos] + [target] + others[pos:]
            logits = torch.randn(len(params), VOCAB, generator=gen)
            logits[pos] = row_logits
            outputs = [[1] * (k + 2) for k in range(len(params))]
            outputs[pos] = history
            out = Sampler(seed=2 + pos)(logits, make_batch(params, outputs))
            positions_tokens[pos].append(out.sampled_token_ids[pos].item())
        history = history + [alone_tokens[-1]]
    for tokens in positions_tokens.values():
        assert tokens == alone_tokens
    assert len(set(alone_tokens)) > 5


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.zeros(1, 1000)

    def run(seed):
        return [Sampler()(logits, make_batch([SamplingParams(seed=seed)], [[0] * step], vocab=1000)
                          ).sampled_token_ids.item() for step in range(10)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_unseeded_rows_repeat_with_the_sampler_seed():
    logits = torch.zeros(16, 500)
    batch = make_batch([SamplingParams()] * 16, vocab=500)
    a = Sampler(seed=5)(logits, batch).sampled_token_ids
    b = Sampler(seed=5)(logits, batch).sampled_token_ids
    c = Sampler(seed=6)(logits, batch).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor, num_draws: int) -> float:
    expected = expected_probs * num_draws
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token the processed distribution excludes"
    return float((((counts[support] - expected[support]) ** 2) / expected[support]).sum())


# 99.99th percentile of chi-square with 11 degrees of freedom: a fixed-seed draw fails
# only if the sampler's distribution is wrong.
CHI2_LIMIT = 37.4
DIST_LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -2.5, -3.0])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_p=0.85),
    SamplingParams(temperature=1.4, top_k=6, min_p=0.1),
])
def test_unseeded_draws_follow_processed_softmax(params):
    num_draws = 30000
    logits = DIST_LOGITS.repeat(num_draws, 1)
    batch = make_batch([params] * num_draws, vocab=DIST_LOGITS.numel())
    tokens = Sampler(seed=11)(logits, batch).sampled_token_ids
    counts = torch.bincount(tokens, minlength=DIST_LOGITS.numel()).float()
    expected = hf_process(DIST_LOGITS, params, [], []).softmax(dim=-1)
    assert chi_square(counts, expected, num_draws) < CHI2_LIMIT


def test_seeded_draws_follow_processed_softmax():
    num_draws = 4000
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(num_draws)]
    logits = DIST_LOGITS.repeat(num_draws, 1)
    batch = make_batch(params, vocab=DIST_LOGITS.numel())
    tokens = Sampler()(logits, batch).sampled_token_ids
    counts = torch.bincount(tokens, minlength=DIST_LOGITS.numel()).float()
    expected = hf_process(DIST_LOGITS, params[0], [], []).softmax(dim=-1)
    assert chi_square(counts, expected, num_draws) < CHI2_LIMIT


def test_request_based_entry_point_matches_batch_entry_point():
    params = [SamplingParams(temperature=0.0, min_tokens=2),
              SamplingParams(seed=3, repetition_penalty=1.2, logprobs=2)]
    requests = [
        SimpleNamespace(params=params[0], prompt_token_ids=[1, 2], output_token_ids=[4],
                        eos_token_ids=frozenset({0})),
        SimpleNamespace(params=params[1], prompt_token_ids=[3], output_token_ids=[5, 6],
                        eos_token_ids=frozenset({0})),
    ]
    logits = torch.randn(2, VOCAB)
    logits[0, 0] = 50.0
    tokens, logprobs = Sampler(seed=0).sample(logits, requests)
    batch = make_batch(params, [[4], [5, 6]], [[1, 2], [3]], eos=[{0}, {0}])
    out = Sampler(seed=0)(logits, batch)
    assert tokens == out.sampled_token_ids.tolist() and tokens[0] != 0
    assert logprobs[0] is None and logprobs[1] == out.logprobs[1]
