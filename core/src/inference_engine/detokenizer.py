"""Incremental detokenization and stop-string matching across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "find_stop", "stop_holdback"]

# Tokens of context decoded before the new ones, so merges and spaces come out right.
WINDOW = 6
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token list into text, only ever emitting certain text.

    Each call decodes a short window ``[prefix, read)`` and ``[prefix, end)``
    and emits the difference, so cost per token does not grow with the output.
    Text ending in U+FFFD (an unfinished multi-byte character) is held back
    until the character completes.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the newly certain text."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if self.prefix_offset > WINDOW:
            # Keep the window short: drop ids nobody will decode again.
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of output: emit whatever is held back, even an incomplete character."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, checked_len: int, stops: Sequence[str],
              include: bool = False) -> tuple[str, str] | None:
    """Earliest stop string in ``text`` not wholly inside the first ``checked_len`` chars.

    Returns (text cut at the stop — the stop itself kept only with
    ``include`` —, the stop string), or None.
    """
    longest = max(len(s) for s in stops)
    start = max(0, checked_len - longest + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    return (text[: at + len(stop)] if include else text[:at]), stop


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Trailing characters of ``text`` that could still become a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
