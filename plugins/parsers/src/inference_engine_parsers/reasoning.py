"""The ``<think>…</think>`` reasoning parsers (format spec, section 3).

All share :class:`~inference_engine.parsing.ThinkReasoningParser`: with
thinking on, output starts inside reasoning, a leading ``<think>`` is dropped,
the first ``</think>`` ends reasoning, and the paired tool parser's call opener
ends it implicitly (the call is then parsed as a call, and the next stray
``</think>`` is dropped). Families differ in the thinking default; MiniMax-M2
also drops every later ``</think>`` from content.
"""

from __future__ import annotations

from typing import Any

from inference_engine.parsing import MarkerSet, Reader, Step, ThinkReasoningParser, copy_all

__all__ = [
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ReasoningParser",
    "Glm45ReasoningParser",
    "MiniMaxM2AppendThinkReasoningParser",
    "MiniMaxM2ReasoningParser",
    "NemotronV3ReasoningParser",
    "Qwen3ReasoningParser",
]


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3, Qwen3.5 (QwQ-style leading ``<think>`` tolerated); thinking on by default."""


class Glm45ReasoningParser(ThinkReasoningParser):
    """GLM-4.5/4.6/4.7, GLM-5; thinking on by default (``thinking`` or ``enable_thinking``)."""


# Outside a tool-call wrapper: "</think>" is removed, the opener switches to inside.
_OUTSIDE_CALL = MarkerSet(["</think>", "<minimax:tool_call>"])
# Inside a tool-call wrapper: text is kept as written up to the closer.
_INSIDE_CALL = MarkerSet(["</minimax:tool_call>"])


class MiniMaxM2ReasoningParser(ThinkReasoningParser):
    """MiniMax-M2 (writes only ``</think>``) and M2.5 (writes both); always thinking.

    Every ``</think>`` after the one that ends reasoning is removed from
    content (``r</think>A</think>B`` gives content ``AB``), except inside a
    ``<minimax:tool_call>`` wrapper, where it is data of the calls; that is
    how vLLM's MiniMax-M2 parser treats it. The filter scans left to right
    like a whole-text scan and holds a tail that could still become a marker,
    so chunking does not change the result.
    """

    is_always_thinking = True

    def __init__(self, tokenizer: Any = None, enable_thinking: bool | None = None) -> None:
        super().__init__(tokenizer, enable_thinking)
        # Content tail that could still become a marker of the current state.
        self._partial_marker = ""
        self._is_inside_call = False

    def emit_content(self, text: str) -> None:
        """Send content with every ``</think>`` outside tool-call wrappers removed."""
        buf = self._partial_marker + text
        start = 0
        while True:
            markers = _INSIDE_CALL if self._is_inside_call else _OUTSIDE_CALL
            hit = markers.search(buf, start)
            if hit is None:
                break
            pos, marker = hit
            keep_to = pos if marker == "</think>" else pos + len(marker)
            if keep_to > start:
                super().emit_content(buf[start:keep_to])
            start = pos + len(marker)
            if marker != "</think>":
                self._is_inside_call = not self._is_inside_call
        end = len(buf) - markers.held(buf, start)
        if end > start:
            super().emit_content(buf[start:end])
        self._partial_marker = buf[end:]

    def grammar(self, r: Reader) -> Step:
        """The base split; at end of stream a held partial marker is plain content."""
        yield from super().grammar(r)
        held, self._partial_marker = self._partial_marker, ""
        if held:
            super().emit_content(held)
        return None


class MiniMaxM2AppendThinkReasoningParser(ThinkReasoningParser):
    """No split: reasoning is None and content is ``"<think>"`` plus the output."""

    def grammar(self, r: Reader) -> Step:
        self.emit_content("<think>")
        yield from copy_all(r, self.emit_content)
        return None


class NemotronV3ReasoningParser(ThinkReasoningParser):
    """Nemotron 3: deepseek_r1 split; with ``enable_thinking=False`` and no content,
    the reasoning is returned as content."""

    swap_when_off = True


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: a plain split, always thinking."""

    is_always_thinking = True


class DeepSeekV3ReasoningParser(ThinkReasoningParser):
    """DeepSeek-V3/V3.1: thinking off unless ``thinking``/``enable_thinking`` is true."""

    thinking_default = False
