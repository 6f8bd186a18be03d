"""vLLM's token-level sampling fields: logit_bias, allowed_token_ids, bad_words,
logprobs=-1, truncate_prompt_tokens. References: transformers' logits processors where
one exists (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor), the field's
definition otherwise; end to end, the banned tokens never come out."""

from __future__ import annotations

import math

import pytest
import torch
from inference_engine import SamplingParams
from inference_engine.sampling import Sampler, SamplingBatch
from inference_engine.testing import cpu_llm, make_tiny_model
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

VOCAB = 50


def _processed(params, outputs=None):
    torch.manual_seed(0)
    logits = torch.randn(len(params), VOCAB)
    outputs = outputs or [[] for _ in params]
    batch = SamplingBatch.from_rows(params, outputs, VOCAB, prompt_token_ids=outputs)
    return logits, Sampler(seed=0).process_logits(logits, batch)


def test_logit_bias_matches_transformers_sequence_bias():
    bias = {3: -100.0, 7: 2.5, 11: 100.0}
    params = [SamplingParams(temperature=0, logit_bias=bias), SamplingParams(temperature=0)]
    logits, processed = _processed(params)
    reference = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(
        torch.zeros(1, 1, dtype=torch.long), logits[:1].clone())
    torch.testing.assert_close(processed[0], reference[0])
    torch.testing.assert_close(processed[1], logits[1])


def test_logit_bias_keys_may_be_strings_as_in_json():
    params = SamplingParams(logit_bias={"5": -1})
    assert params.logit_bias == {5: -1.0}
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={"x": 1})


def test_allowed_token_ids_keep_only_those():
    allowed = [4, 9, 30]
    logits, processed = _processed([SamplingParams(temperature=0, allowed_token_ids=allowed),
                                    SamplingParams(temperature=0)])
    expected = torch.full((VOCAB,), float("-inf"))
    expected[allowed] = logits[0, allowed]
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], logits[1])


def test_bad_words_match_transformers_no_bad_words():
    words = [[5], [8, 9], [1, 2, 3]]
    history = [[7, 8], [1, 2], [4]]
    params = [SamplingParams(temperature=0.7, bad_words=["x"]) for _ in history]
    for p in params:
        p.bad_words_token_ids = words  # as update_from_tokenizer would set them
    logits, processed = _processed(params, history)
    processor = NoBadWordsLogitsProcessor(words, eos_token_id=VOCAB + 1)
    for row, output in enumerate(history):
        reference = processor(torch.tensor([output]), logits[row:row + 1].clone())[0]
        reference = reference / 0.7
        torch.testing.assert_close(processed[row], reference)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return cpu_llm(make_tiny_model(tmp_path_factory.mktemp("fields")), dtype="float32")


def test_banned_and_disallowed_tokens_never_come_out(llm):
    prompts = ["The quick brown fox", "hello there"]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    common = {t for o in plain for t in o.outputs[0].token_ids}
    banned = sorted(common)[:5]
    biased = llm.generate(prompts, SamplingParams(
        temperature=0.9, seed=1, max_tokens=40, ignore_eos=True,
        logit_bias={t: -100 for t in banned}))
    assert not {t for o in biased for t in o.outputs[0].token_ids} & set(banned)
    allowed = sorted(common)[5:12]
    only = llm.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                                                ignore_eos=True, allowed_token_ids=allowed))
    assert {t for o in only for t in o.outputs[0].token_ids} <= set(allowed)


def test_bad_words_never_appear_in_the_text(llm):
    tokenizer = llm.get_tokenizer()
    prompt = "The quick brown fox"
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                     ignore_eos=True))
    word = tokenizer.decode(plain.outputs[0].token_ids[3:5]).strip()
    assert word
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                   ignore_eos=True, bad_words=[word]))
    sequences = out.outputs[0].token_ids
    for ids in _tokenized([word], tokenizer):
        assert not any(sequences[i:i + len(ids)] == ids
                       for i in range(len(sequences) - len(ids) + 1)), (word, ids)


def _tokenized(words, tokenizer):
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(tokenizer, len(tokenizer))
    return params.bad_words_token_ids


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    vocab = llm.engine.model.ctx.hf_config.vocab_size
    (out,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, logprobs=-1,
                                                    prompt_logprobs=-1))
    for position in out.outputs[0].logprobs:
        assert len(position) == vocab
        assert math.isclose(sum(math.exp(e.logprob) for e in position.values()), 1.0,
                            rel_tol=1e-4)
    assert all(len(p) == vocab for p in out.prompt_logprobs[1:])


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    tokenizer = llm.get_tokenizer()
    prompt = "Paged attention stores keys and values in fixed size blocks."
    ids = tokenizer.encode(prompt)
    (cut,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                   truncate_prompt_tokens=4))
    (tail,) = llm.generate([{"prompt_token_ids": ids[-4:]}],
                           SamplingParams(temperature=0, max_tokens=8))
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids


def test_token_ids_outside_the_vocabulary_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["a"], SamplingParams(allowed_token_ids=[10**6]))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["a"], SamplingParams(logit_bias={10**6: 1}))
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens=False)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    prompts = ["The quick brown fox", "hello"]
    params = dict(temperature=0.8, seed=4, max_tokens=12, n=2)
    with_text = llm.generate(prompts, SamplingParams(**params))
    ids_only = llm.generate(prompts, SamplingParams(**params, detokenize=False))
    for a, b in zip(with_text, ids_only, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(c.text for c in a.outputs) and all(c.text == "" for c in b.outputs)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])
