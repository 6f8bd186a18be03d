"""Host cost of incremental detokenization per engine step, for many concurrent streams.

Every streamed (not ``final_only``) request decodes its window of recent tokens twice per
step (``IncrementalDetokenizer``). This bench feeds N streams one token each per step and
times a step, in one process, alternating: the window decoded by the Rust tokenizer
directly (``detokenizer.window_decoder``, what the engine uses for a plain transformers fast
tokenizer) and by the tokenizer's own ``decode`` (transformers' Python wrapper: the
reference, and what other tokenizers get). Both must emit the same text, which is checked.

The tokenizer is a byte-level BPE trained here on Python's own docstrings (no download).

Run:  .venv/bin/python bench/detokenize_streams.py [--streams 64] [--tokens 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from inference_engine import detokenizer
from inference_engine.detokenizer import IncrementalDetokenizer


def train_tokenizer():
    import pydoc

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [pydoc.getdoc(obj) for obj in (str, list, dict, random, time, argparse)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


def step_ms(tokenizer, prompts, outputs, fast: bool) -> tuple[float, list[str]]:
    """Median ms of a step (every stream gets one token) and the streams' texts."""
    original = detokenizer.window_decoder
    if not fast:  # the tokenizer's own decode, as for any tokenizer without the fast path
        detokenizer.window_decoder = (
            lambda tok, skip: lambda ids: tok.decode(ids, skip_special_tokens=skip))
    try:
        streams = [IncrementalDetokenizer(tokenizer, p) for p in prompts]
    finally:
        detokenizer.window_decoder = original
    times = []
    for i in range(len(outputs[0])):
        start = time.perf_counter()
        for stream, out in zip(streams, outputs, strict=True):
            stream.add_tokens(out[i : i + 1])
        times.append(time.perf_counter() - start)
    for stream in streams:
        stream.flush()
    return statistics.median(times) * 1e3, [s.text for s in streams]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = train_tokenizer()
    rng = random.Random(0)
    vocab = len(tokenizer)
    prompts = [[rng.randrange(vocab) for _ in range(32)] for _ in range(args.streams)]
    outputs = [[rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(args.streams)]
    runs: dict[bool, list[float]] = {True: [], False: []}
    texts: dict[bool, list[str]] = {}
    for _ in range(args.repeats):
        for fast in (False, True):
            ms, texts[fast] = step_ms(tokenizer, prompts, outputs, fast)
            runs[fast].append(ms)
    assert texts[True] == texts[False], "the two decoders emitted different text"
    slow, quick = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"{args.streams} streams, ms per step (median of {args.repeats} runs of "
          f"{args.tokens} steps):")
    for name, fast, ms in (("tokenizer.decode (transformers)", False, slow),
                           ("Rust decode (window_decoder)", True, quick)):
        print(f"  {name:32s} {ms:.3f}  runs {[round(x, 3) for x in runs[fast]]}")
    print(f"  ratio {slow / quick:.2f}x; texts identical")


if __name__ == "__main__":
    main()
