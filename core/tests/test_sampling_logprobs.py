"""Logprobs: raw log-softmax values, ranks and top-N, for samples and prompts."""

from __future__ import annotations

import pytest
import torch

from inference_engine.sampling import Logprob, Sampler, SamplingBatch, compute_prompt_logprobs
from inference_engine.sampling.logprobs import prompt_logprobs
from inference_engine.sampling_params import SamplingParams

VOCAB = 50


def reference_rank(row_logprobs: torch.Tensor, token: int) -> int:
    order = torch.argsort(row_logprobs, descending=True).tolist()
    return order.index(token) + 1


def check_entry(entry: dict[int, Logprob], row_logits: torch.Tensor, token: int, num: int):
    ref = torch.log_softmax(row_logits.double(), dim=-1)
    keys = list(entry)
    assert keys[0] == token
    assert entry[token].rank == reference_rank(ref, token)
    top = torch.topk(ref, num).indices.tolist()
    assert set(keys) == {token, *top}
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(ref[t].item(), abs=1e-5)
        if t in top and t != token:
            assert lp.rank == top.index(t) + 1


def test_sample_logprobs_are_raw_log_softmax_with_ranks():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen) * 2
    params = [
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=2.0),
        SamplingParams(),
        SamplingParams(logprobs=0, top_k=5),
        SamplingParams(logprobs=5, temperature=0.0, presence_penalty=1.0),
        SamplingParams(logprobs=1, seed=4, min_p=0.2),
    ]
    outputs = [[1, 2], [], [3], [int(logits[3].argmax())], []]
    batch = SamplingBatch.from_rows(params, outputs, VOCAB, prompt_token_ids=[[4]] * 5)
    out = Sampler(seed=0)(logits, batch)
    tokens = out.sampled_token_ids.tolist()
    assert out.logprobs[1] is None
    for i in (0, 2, 3, 4):
        check_entry(out.logprobs[i], logits[i], tokens[i], params[i].logprobs)
    # Row 3 is greedy with a presence penalty on its argmax: a rank-2+ token was picked.
    assert out.logprobs[3][tokens[3]].rank > 1


def test_greedy_logprobs_without_penalties_report_rank_one():
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 3
    out = Sampler()(logits, SamplingBatch.from_rows(params, [[]] * 3, VOCAB))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    for i, token in enumerate(out.sampled_token_ids.tolist()):
        assert out.logprobs[i][token].rank == 1
        assert len(out.logprobs[i]) == 2


def test_decoded_token_comes_from_the_tokenizer():
    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    logits = torch.randn(1, VOCAB)
    out = Sampler(tokenizer=Tok())(
        logits, SamplingBatch.from_rows([SamplingParams(logprobs=2)], [[]], VOCAB))
    assert all(lp.decoded_token == f"<{t}>" for t, lp in out.logprobs[0].items())


def test_prompt_logprobs_first_position_is_none_and_rows_predict_next_token():
    gen = torch.Generator().manual_seed(1)
    prompt = [5, 9, 2, 2, 40]
    logits = torch.randn(len(prompt), VOCAB, generator=gen)
    result = compute_prompt_logprobs(logits, prompt, 2)
    assert len(result) == len(prompt) and result[0] is None
    for j in range(1, len(prompt)):
        check_entry(result[j], logits[j - 1], prompt[j], 2)
    # Without the last row (which predicts the first generated token) it is the same.
    assert compute_prompt_logprobs(logits[:-1], prompt, 2) == result
    assert compute_prompt_logprobs(logits[:1], [7], 3) == [None]


def test_chunked_prompt_logprobs_equal_whole_prompt():
    prompt = [1, 2, 3, 4, 5, 6]
    logits = torch.randn(len(prompt), VOCAB)
    whole = compute_prompt_logprobs(logits, prompt, 1)
    chunked = [None] + prompt_logprobs(logits[:3], prompt[1:4], 1) + prompt_logprobs(
        logits[3:5], prompt[4:6], 1)
    assert chunked == whole


def test_too_few_prompt_logit_rows_raise():
    with pytest.raises(ValueError, match="rows of logits"):
        compute_prompt_logprobs(torch.randn(2, VOCAB), [1, 2, 3, 4], 1)
