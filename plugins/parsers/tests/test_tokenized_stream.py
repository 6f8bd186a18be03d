"""Deltas as a server makes them: token ids decoded one token at a time (tiny offline tokenizer)."""

from __future__ import annotations

import pytest

from inference_engine_parsers.testing import TOOLS, exact, factory

tokenizers = pytest.importorskip("tokenizers")

OUTPUT = ("Let me look.\n</think>\n\nChecking ø.\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
          "</tool_call>")
SPECIALS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([OUTPUT, "parameter function Oslo weather"], trainer=trainer)
    return tok


def test_token_by_token_deltas_give_the_one_shot_result(tokenizer):
    ids = tokenizer.encode(OUTPUT).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == OUTPUT
    pipeline = factory("qwen3_coder", "qwen3").create(tokenizer=tokenizer, tools=TOOLS)
    text_so_far = ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=False)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            continue
        pipeline.feed(text[len(text_so_far):], ids[n - 1: n])
        text_so_far = text
    pipeline.finish()
    want = factory("qwen3_coder", "qwen3").parse(OUTPUT, tools=TOOLS)
    assert exact(pipeline.result()) == exact(want)
    assert want.simple() == {"reasoning": "Let me look.", "content": "Checking ø.",
                             "tool_calls": [{"name": "get_weather",
                                             "arguments": {"city": "Oslo", "days": 2}}]}
