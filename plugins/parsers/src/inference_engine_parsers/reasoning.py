"""The ``<think>…</think>`` reasoning parsers (format spec, section 3).

All share :class:`~inference_engine.parsing.ThinkReasoningParser`: with
thinking on, output starts inside reasoning, a leading ``<think>`` is dropped,
the first ``</think>`` ends reasoning, and the paired tool parser's call opener
ends it implicitly (the call is then parsed as a call, and the next stray
``</think>`` is dropped). Families differ in the thinking default.
"""

from __future__ import annotations

from inference_engine.parsing import Reader, Step, ThinkReasoningParser, copy_all

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


class MiniMaxM2ReasoningParser(ThinkReasoningParser):
    """MiniMax-M2 (writes only ``</think>``) and M2.5 (writes both); always thinking."""

    is_always_thinking = True


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
