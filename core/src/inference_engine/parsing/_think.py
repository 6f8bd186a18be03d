"""A streaming ``<think>…</think>`` reasoning parser that families configure.

With thinking on, parsing starts inside reasoning (the chat template usually
opened ``<think>`` in the prompt): a leading ``<think>`` is dropped, the first
``</think>`` ends reasoning, and a tool-call opener of the paired tool parser
(:meth:`set_call_openers`) ends it implicitly, just before the opener; the
next stray ``</think>`` in content is then dropped. No ``</think>`` at all
means everything is reasoning. With thinking off everything is content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference_engine.interfaces.parsers import CallOpener, ParsedDelta, ReasoningParser
from inference_engine.parsing._driver import ReaderDriven
from inference_engine.parsing._reader import (
    MarkerSet,
    Reader,
    Step,
    copy_all,
    followed_by,
    match,
    skip_ws,
    until,
)

__all__ = ["ThinkReasoningParser"]


class ThinkReasoningParser(ReaderDriven, ReasoningParser):
    """Reasoning between think markers; subclasses set the class attributes."""

    start_marker = "<think>"
    end_marker = "</think>"
    # Whether thinking is on when the request does not say (enable_thinking=None).
    thinking_default = True
    # Thinking is on whatever the request says (the model cannot switch it off).
    is_always_thinking = False
    # With enable_thinking=False: parse as if on, and if no content results,
    # return the reasoning as content (nemotron_v3). Reasoning is held back
    # until content shows up, so the split does not depend on chunking.
    swap_when_off = False

    def __init__(self, tokenizer: Any = None, enable_thinking: bool | None = None) -> None:
        super().__init__(tokenizer, enable_thinking)
        self.call_openers: tuple[CallOpener, ...] = ()
        self._is_swap_pending = self.swap_when_off and enable_thinking is False
        if self.is_always_thinking or self._is_swap_pending:
            self.is_thinking = True
        else:
            self.is_thinking = self.thinking_default if enable_thinking is None \
                else bool(enable_thinking)
        self._reader = Reader()
        self._grammar: Step | None = None
        self._is_finished = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        # While a swap is pending: reasoning and (blank) content held back.
        self._held_reasoning: list[str] = []
        self._held_content: list[str] = []

    def set_call_openers(self, openers: Sequence[CallOpener]) -> None:
        """Openers that end reasoning implicitly; call before the first feed."""
        if self._grammar is not None:
            raise RuntimeError("set_call_openers() after feed()")
        self.call_openers = tuple(openers)

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        """Consume one text delta; return the reasoning/content now certain."""
        self._feed_text(text)
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of stream: flush anything held back."""
        if self._end_stream():
            if self._is_swap_pending:  # no content came: the reasoning is the content
                self._is_swap_pending = False
                self._content.extend(self._held_reasoning + self._held_content)
        return self._take()

    def _step(self) -> None:
        if self._grammar is None:
            self._grammar = self.grammar(self._reader)
        try:
            self._grammar.send(None)
        except StopIteration:
            pass
        self._reader.trim(self._reader.pos)

    def _take(self) -> ParsedDelta:
        delta = ParsedDelta(reasoning="".join(self._reasoning), content="".join(self._content))
        self._reasoning, self._content = [], []
        return delta

    def emit_reasoning(self, text: str) -> None:
        """Send reasoning text (held while a swap is pending)."""
        (self._held_reasoning if self._is_swap_pending else self._reasoning).append(text)

    def emit_content(self, text: str) -> None:
        """Send content text; the first non-blank content settles a pending swap."""
        if not self._is_swap_pending:
            self._content.append(text)
            return
        self._held_content.append(text)
        if text.strip():
            self._is_swap_pending = False
            self._reasoning.extend(self._held_reasoning)
            self._content.extend(self._held_content)
            self._held_reasoning, self._held_content = [], []

    def grammar(self, r: Reader) -> Step:
        """The split as a generator over ``r``; override for other layouts."""
        if not self.is_thinking:
            yield from copy_all(r, self.emit_content)
            return None
        yield from skip_ws(r)
        yield from match(r, self.start_marker)  # tolerated, dropped
        follows: dict[str, tuple[str, ...]] = {}
        for opener in self.call_openers:
            follows[opener.marker] = (*follows.get(opener.marker, ()), opener.follow)
        markers = MarkerSet([self.end_marker, *follows])
        while True:
            marker = yield from until(r, markers, self.emit_reasoning)
            if marker is None:
                return None  # no end marker: all reasoning
            if marker == self.end_marker:
                break
            is_call = yield from followed_by(r, follows[marker])
            if is_call:  # implicit end: the opener starts content
                self.emit_content(marker)
                stray = yield from until(r, MarkerSet([self.end_marker]), self.emit_content)
                if stray is None:
                    return None
                break
            self.emit_reasoning(marker)
        yield from copy_all(r, self.emit_content)
        return None
