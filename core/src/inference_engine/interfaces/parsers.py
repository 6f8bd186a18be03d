"""Streaming reasoning and tool-call parser interfaces.

A parser is fed text deltas (and the token ids behind them) as they are
generated and answers OpenAI-shaped deltas. Non-streaming parsing is the same
machine fed the whole text followed by :meth:`finish`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedDelta", "ReasoningParser", "ToolCallDelta", "ToolParser"]


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of a tool call: a header (index, id, name) or argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedDelta:
    """What one feed produced; all fields may be empty."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class ReasoningParser(ABC):
    """Splits reasoning from content in a stream."""

    def __init__(self, tokenizer: Any = None, enable_thinking: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking

    @abstractmethod
    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        """Consume one text delta; return the reasoning/content now certain."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """End of stream: flush anything held back."""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Non-streaming: (reasoning, content), each None when empty."""
        first, last = self.feed(text), self.finish()
        reasoning = (first.reasoning + last.reasoning).strip()
        content = (first.content + last.content).strip()
        return (reasoning or None, content or None)


class ToolParser(ABC):
    """Extracts tool calls from content in a stream."""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None,
                 mode: str = "incremental") -> None:
        self.tokenizer = tokenizer
        self.tools = tools or []
        self.mode = mode

    @abstractmethod
    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        """Consume one content delta; return content and tool-call deltas now certain."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """End of stream: flush held text; unfinished calls become content."""
