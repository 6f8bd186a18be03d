"""IncrementalDetokenizer against tokenizer.decode of the whole output."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inference_engine.detokenizer import PROMPT_CONTEXT, IncrementalDetokenizer, StopChecker

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld 你好 🎉",
    "naïve café, 日本語のテキスト, emoji 🚀🎉👍🏽 and more",
    "def add(a, b):\n    return a + b\n",
]


@functools.cache
def byte_level_tokenizer():
    """Byte-level BPE (GPT-2 style): CJK and emoji split into byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)


@functools.cache
def metaspace_tokenizer():
    """SentencePiece-style: "▁" marks spaces and decode strips the leading one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXTS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunks: list[int]) -> list[str]:
    """Feed ``token_ids`` in chunks of the given sizes, then one at a time (``add_token``, the
    engine's per-step call); return every emitted delta."""
    deltas, at, sizes = [], 0, iter(chunks)
    while at < len(token_ids):
        size = next(sizes, None)
        if size is None:
            deltas.append(detok.add_token(token_ids[at]))
            at += 1
            continue
        deltas.append(detok.add_tokens(token_ids[at : at + size]))
        at += size
    return deltas


def check_stream(tokenizer, prompt_ids, output_ids, chunks, skip):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    deltas = stream(detok, output_ids, chunks)
    # The reference: what the output adds to the decoded prompt (for byte-level
    # tokenizers, also just decode(output)).
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
    whole = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip)
    assert whole.startswith(prompt_text)
    expected = whole[len(prompt_text) :]
    emitted = ""
    for delta in deltas:
        emitted += delta
        # Nothing emitted is ever taken back.
        assert expected.startswith(emitted)
    emitted += detok.flush()
    assert emitted == expected == detok.text
    return expected


def check_token_by_token(tokenizer, output, prompt, skip):
    """:func:`check_stream` one token at a time, as the engine streams, through tokenizers'
    DecodeStream; returns (the expected text, the output ids used)."""
    output = [t % len(tokenizer) for t in output]
    prompt_ids = tokenizer.encode(prompt)
    assert IncrementalDetokenizer(tokenizer, prompt_ids, skip)._stream is not None
    return check_stream(tokenizer, prompt_ids, output, [], skip), output


PROMPTS = ["", "Say: ", "你好", "héllo wörld 🎉 "]
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    output=st.lists(st.integers(0, 319), max_size=30),
    chunks=st.lists(st.integers(1, 4), max_size=30),
    prompt=st.sampled_from(PROMPTS),
    skip=st.booleans(),
)
def test_byte_level_random_streams_equal_decode_of_all(output, chunks, prompt, skip):
    tokenizer = byte_level_tokenizer()
    output = [t % len(tokenizer) for t in output]
    expected = check_stream(tokenizer, tokenizer.encode(prompt), output, chunks, skip)
    assert expected == tokenizer.decode(output, skip_special_tokens=skip)


@SETTINGS
@given(
    text=st.text(alphabet=st.sampled_from(list("ab 你好🎉éö\n")), max_size=25),
    chunks=st.lists(st.integers(1, 3), max_size=30),
    prompt=st.sampled_from(PROMPTS),
)
def test_byte_level_text_round_trips_with_emoji_and_cjk_split(text, chunks, prompt):
    tokenizer = byte_level_tokenizer()
    output = tokenizer.encode(text)
    assert check_stream(tokenizer, tokenizer.encode(prompt), output, chunks, True) == text


@SETTINGS
@given(
    output=st.lists(st.integers(0, 149), max_size=30),
    chunks=st.lists(st.integers(1, 4), max_size=30),
    prompt=st.sampled_from(["", "hello", "the quick brown"]),
    skip=st.booleans(),
)
def test_metaspace_random_streams_keep_spaces_between_tokens(output, chunks, prompt, skip):
    tokenizer = metaspace_tokenizer()
    output = [t % len(tokenizer) for t in output]
    check_stream(tokenizer, tokenizer.encode(prompt), output, chunks, skip)


@SETTINGS
@given(
    output=st.lists(st.integers(0, 319), max_size=40),
    prompt=st.sampled_from(PROMPTS),
    skip=st.booleans(),
)
def test_byte_level_token_by_token_through_the_decode_stream(output, prompt, skip):
    tokenizer = byte_level_tokenizer()
    expected, output = check_token_by_token(tokenizer, output, prompt, skip)
    assert expected == tokenizer.decode(output, skip_special_tokens=skip)


@SETTINGS
@given(
    output=st.lists(st.integers(0, 149), max_size=40),
    prompt=st.sampled_from(["", "hello", "the quick brown"]),
    skip=st.booleans(),
)
def test_metaspace_token_by_token_through_the_decode_stream(output, prompt, skip):
    check_token_by_token(metaspace_tokenizer(), output, prompt, skip)


def test_invalid_bytes_are_released_after_max_pending_tokens_one_at_a_time():
    # A run of lone UTF-8 continuation bytes never completes a character: past MAX_PENDING
    # tokens the text is emitted anyway (U+FFFD included), token by token as in bulk.
    from inference_engine.detokenizer import MAX_PENDING

    tokenizer = byte_level_tokenizer()
    byte_id = tokenizer.convert_tokens_to_ids("\u0122")  # GPT-2's symbol for byte 0x80
    assert tokenizer.decode([byte_id]) == "\ufffd"
    output = [byte_id] * (MAX_PENDING + 5)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("ok "))
    deltas = [detok.add_token(t) for t in output]
    assert all(d == "" for d in deltas[: MAX_PENDING - 1])
    assert any(deltas[MAX_PENDING - 1 :])
    detok.flush()
    assert detok.text == tokenizer.decode(output)


def test_split_emoji_is_held_back_until_complete():
    tokenizer = byte_level_tokenizer()
    emoji_ids = tokenizer.encode("👍🏽")
    assert len(emoji_ids) > 2, "the test needs an emoji spread over several tokens"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("ok "))
    deltas = [detok.add_tokens([t]) for t in emoji_ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "👍🏽"
    assert deltas[0] == ""


def test_metaspace_first_output_token_keeps_its_space_after_a_prompt():
    tokenizer = metaspace_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello"))
    ids = tokenizer.encode("world")
    assert "".join(detok.add_tokens([t]) for t in ids) == " world"
    # With no prompt, decode's leading-space strip applies, as in decode(output).
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.add_tokens([t]) for t in ids) == "world"


def test_special_tokens_are_skipped_or_kept():
    tokenizer = byte_level_tokenizer()
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hi") + [eos] + tokenizer.encode(" there")
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [])
    for t in ids:
        kept.add_tokens([t])
        skipped.add_tokens([t])
    assert kept.text == "hi<|im_end|> there"
    assert skipped.text == "hi there"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, inner):
        self.inner = inner
        self.all_special_ids = inner.all_special_ids
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("factory", [byte_level_tokenizer, metaspace_tokenizer])
def test_work_per_token_does_not_grow_with_output(factory):
    inner = factory()
    tokenizer = CountingTokenizer(inner)
    ids = inner.encode(" ".join(TEXTS) * 20)
    prompt = inner.encode("the quick brown")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    for t in ids:
        detok.add_tokens([t])
    for _ in range(200):  # a long run of skipped special tokens
        detok.add_tokens([inner.eos_token_id])
    detok.flush()
    assert len(ids) > 500
    assert detok.text == inner.decode(prompt + ids)[len(inner.decode(prompt)) :]
    assert max(tokenizer.lengths) <= PROMPT_CONTEXT + 8


def test_stop_string_inside_multibyte_tokens_cuts_at_character_boundary():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("héllo 你好🎉 wörld")
    detok = IncrementalDetokenizer(tokenizer, [])
    checker = StopChecker(["好🎉"])
    match = None
    for t in ids:
        delta = detok.add_tokens([t])
        match = checker.check(detok.text, len(delta))
        if match:
            break
    assert match is not None and match.text == "héllo 你"


@pytest.mark.parametrize("factory", [byte_level_tokenizer, metaspace_tokenizer])
@pytest.mark.parametrize("skip", [True, False])
def test_window_decoder_equals_the_tokenizers_decode(factory, skip):
    import random

    from inference_engine.detokenizer import window_decoder

    tokenizer = factory()
    decode = window_decoder(tokenizer, skip)
    assert decode.__name__ == "fast"  # a plain fast tokenizer: the Rust decode directly
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        ids += list(tokenizer.all_special_ids)[: rng.randrange(3)]
        rng.shuffle(ids)
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert decode(tuple(ids)) == decode(ids)


def test_window_decoder_keeps_a_tokenizers_own_decode():
    from inference_engine.detokenizer import window_decoder
    from transformers import PreTrainedTokenizerFast

    base = byte_level_tokenizer()

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=base.backend_tokenizer, clean_up_tokenization_spaces=False)
    ids = base.encode("quick fox")
    assert window_decoder(shouting, True)(ids) == "QUICK FOX"
    cleaning = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer,
                                       clean_up_tokenization_spaces=True)
    assert window_decoder(cleaning, True).__name__ == "general"
    assert window_decoder(cleaning, True)(ids) == cleaning.decode(ids, skip_special_tokens=True)
