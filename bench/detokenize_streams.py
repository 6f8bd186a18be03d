"""Host cost of incremental detokenization per engine step, for many concurrent streams.

Every streamed (not ``final_only``) request detokenizes one token per step
(``IncrementalDetokenizer.add_token``). This bench feeds N streams one token each per step
and times a step, in one process, alternating three ways of decoding the same window:

* ``decode``: the tokenizer's own ``decode`` twice per token (transformers' Python wrapper:
  the reference, and what a tokenizer without the fast paths gets);
* ``rust``: the Rust tokenizer's ``decode`` twice per token, called directly;
* ``stream``: ``tokenizers.decoders.DecodeStream``, one call per token (the engine's choice
  for a plain transformers fast tokenizer).

All three must emit the same text, which is checked.

The tokenizer is a byte-level BPE trained here on Python's own docstrings (no download).

Run:  .venv/bin/python bench/detokenize_streams.py [--streams 64] [--tokens 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

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


MODES = ("decode", "rust", "stream")


def make_stream(tokenizer, prompt: list[int], mode: str) -> IncrementalDetokenizer:
    """A detokenizer that decodes its window the way ``mode`` names."""
    stream = IncrementalDetokenizer(tokenizer, prompt)
    if mode == "stream":  # as the engine makes it (Python where the prompt ends mid-character)
        return stream
    stream._stream = None  # the window decoded twice per token, in Python
    if mode == "decode":
        stream._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return stream


def step_ms(tokenizer, prompts, outputs, mode: str) -> tuple[float, list[str]]:
    """Median ms of a step (every stream gets one token) and the streams' texts."""
    streams = [make_stream(tokenizer, p, mode) for p in prompts]
    times = []
    for i in range(len(outputs[0])):
        start = time.perf_counter()
        for stream, out in zip(streams, outputs, strict=True):
            stream.add_token(out[i])
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
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    texts: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for mode in MODES:
            ms, texts[mode] = step_ms(tokenizer, prompts, outputs, mode)
            runs[mode].append(ms)
    assert texts["rust"] == texts["decode"] == texts["stream"], "the decoders' texts differ"
    medians = {mode: statistics.median(runs[mode]) for mode in MODES}
    print(f"{args.streams} streams, ms per step (median of {args.repeats} runs of "
          f"{args.tokens} steps):")
    for mode in MODES:
        print(f"  {mode:7s} {medians[mode]:.3f}  runs {[round(x, 3) for x in runs[mode]]}  "
              f"({medians['decode'] / medians[mode]:.2f}x of decode)")
    with_stream = sum(make_stream(tokenizer, p, "stream")._stream is not None for p in prompts)
    print(f"  texts identical; {with_stream} of {len(prompts)} streams got a DecodeStream")

if __name__ == "__main__":
    main()
