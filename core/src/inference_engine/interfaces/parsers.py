"""Streaming reasoning and tool-call parser interfaces.

A parser is fed text deltas (and the token ids behind them) as they are
generated and answers OpenAI-shaped deltas. Non-streaming parsing is the same
machine fed the whole text followed by :meth:`finish`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallOpener", "ParsedDelta", "ReasoningParser", "ToolCallDelta", "ToolCallTag",
           "ToolParser"]


@dataclass(frozen=True, slots=True)
class CallOpener:
    """Where a tool parser's call starts, so reasoning can end implicitly there.

    The opener is ``marker``, then optional whitespace, then ``follow``
    (``"<tool_call>"`` then ``"{"`` for hermes JSON). An empty ``follow``
    means the bare marker is enough.
    """

    # Literal text that starts a call block.
    marker: str
    # Text that must come after the marker (and optional whitespace); "" for none.
    follow: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallTag:
    """How a format writes one call, so a grammar can force calls (``tool_choice``
    "required"/named, ``strict`` tools): ``begin`` (with ``{name}`` where the function's
    name goes), the arguments, then ``end``. ``trigger`` is the prefix of ``begin`` that
    opens any call.

    ``style`` is how the arguments are written, in xgrammar's names for a JSON schema's
    ``style``: ``"json"`` (an object), ``"qwen_xml"`` (``<parameter=K>V</parameter>``),
    ``"minimax_xml"`` (``<parameter name="K">V</parameter>``), ``"glm_xml"``
    (``<arg_key>K</arg_key><arg_value>V</arg_value>``). ``name_in_json_string`` says the
    name sits inside a JSON string (so it is JSON-escaped there). ``whitespace``, when set,
    is the only whitespace the format's parser expects between the parts of the arguments
    (around each value): xgrammar's XML styles allow any run of spaces, tabs and newlines
    there while these parsers keep all but one newline of a value, so a value forced to an
    enum could be read back with a tab in front; the grammar is narrowed to it.
    """

    begin: str
    end: str
    trigger: str
    style: str = "json"
    name_in_json_string: bool = True
    whitespace: str | None = None

    def begin_for(self, name: str) -> str:
        """``begin`` with ``name`` in place (JSON-escaped where it sits in a JSON string)."""
        return self.begin.replace(
            "{name}", json.dumps(name)[1:-1] if self.name_in_json_string else name)


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

    def set_call_openers(self, openers: Sequence[CallOpener]) -> None:
        """Tell the parser where the paired tool parser's calls start.

        Called by the pipeline before the first :meth:`feed`. A parser that
        supports an *implicit end* of reasoning ends it just before such an
        opener, so a call written inside reasoning is parsed as a call. The
        default only records the openers.

        Args:
            openers: the tool parser's :attr:`ToolParser.call_openers`.
        """
        self.call_openers = tuple(openers)

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

    # Openers that end reasoning implicitly when they appear inside it (see
    # :meth:`ReasoningParser.set_call_openers`); empty for none.
    call_openers: tuple[CallOpener, ...] = ()
    # How one call is written, for grammars that force calls; None: this format cannot
    # be forced (tool_choice is then checked after generation and strict tools refused).
    call_tag: ToolCallTag | None = None

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

    def parse(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        """Non-streaming: (content or None, the deltas of every call)."""
        first, last = self.feed(text), self.finish()
        content = (first.content + last.content).strip()
        return (content or None, first.tool_calls + last.tool_calls)
