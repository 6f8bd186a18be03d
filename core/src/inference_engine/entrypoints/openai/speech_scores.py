"""A Whisper window's quality scores as openai/whisper reports them on its segments.

openai/whisper's ``DecodingResult`` scores one decoded window and ``transcribe`` copies
the scores onto every segment cut from it; ``verbose_json`` does the same here:

- ``avg_logprob``: the sum of the sampled tokens' log-probabilities up to and including
  the end-of-text token, divided by the number of tokens before it plus one (its
  ``sum_logprobs / (len(tokens) + 1)``). The log-probabilities are the model's raw
  distribution (log-softmax of the logits, before temperature), as the engine reports
  them; openai/whisper's suppression filters are not applied here (docs/server.md).
- ``compression_ratio``: UTF-8 bytes of the window's text over their zlib-compressed size
  (its ``get_compression_ratio``; a high ratio flags repetition loops).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

__all__ = ["WindowScores", "compression_ratio", "window_scores"]


@dataclass(frozen=True, slots=True)
class WindowScores:
    """openai/whisper's per-window scores, copied onto each of the window's segments."""

    avg_logprob: float
    compression_ratio: float


def compression_ratio(text: str) -> float:
    """``len(utf8) / len(zlib.compress(utf8))``, openai/whisper's ``get_compression_ratio``."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


def window_scores(token_ids: Sequence[int], token_logprobs: Sequence[float],
                  eos_ids: Collection[int], timestamp_begin: int,
                  decode: Callable[[list[int]], str]) -> WindowScores:
    """Score one window's generated tokens.

    Args:
        token_ids: the generated tokens, as sampled (an end token, if any, last).
        token_logprobs: each sampled token's log-probability, parallel to ``token_ids``.
        eos_ids: end-of-text tokens.
        timestamp_begin: id of ``<|0.00|>``; timestamps are left out of the text, as
            openai/whisper's tokenizer decodes it.
        decode: token ids -> text.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(token_ids) != len(token_logprobs):
        raise ValueError(f"{len(token_ids)} tokens but {len(token_logprobs)} logprobs")
    total, text_tokens = 0.0, []
    for token, logprob in zip(token_ids, token_logprobs, strict=True):
        total += logprob
        if token in eos_ids:
            break
        text_tokens.append(token)
    text = decode([t for t in text_tokens if t < timestamp_begin])
    return WindowScores(total / (len(text_tokens) + 1), compression_ratio(text))
