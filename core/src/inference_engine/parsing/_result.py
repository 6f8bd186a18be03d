"""Parse results and the OpenAI chat-completions shapes of deltas and messages."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from inference_engine.interfaces.parsers import ParsedDelta

__all__ = ["DeltaAccumulator", "ParseResult", "to_openai_delta"]


class ParseResult(NamedTuple):
    """One parsed assistant message; unpacks as ``(reasoning, content, tool_calls)``."""

    # Reasoning text, outer whitespace stripped; None when empty.
    reasoning: str | None
    # Text outside reasoning and calls, joined in order and stripped; None when empty.
    content: str | None
    # OpenAI tool calls: {"id", "type": "function", "function": {"name", "arguments"}},
    # arguments a JSON text.
    tool_calls: list[dict[str, Any]]

    @property
    def finish_reason(self) -> str | None:
        """``"tool_calls"`` when there is a call, else None (keep the engine's reason)."""
        return "tool_calls" if self.tool_calls else None

    def to_openai_message(self) -> dict[str, Any]:
        """The ``choices[0].message`` object; reasoning is sent under both names."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content,
            "reasoning_content": self.reasoning,
            "reasoning": self.reasoning,
        }
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def simple(self) -> dict[str, Any]:
        """``{"reasoning", "content", "tool_calls": [{"name", "arguments": object}]}``.

        The ``inference-engine parse`` output; arguments that are not valid
        JSON (a call cut off in incremental mode) stay a string.
        """
        calls = []
        for call in self.tool_calls:
            arguments: Any = call["function"]["arguments"]
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
            calls.append({"name": call["function"]["name"], "arguments": arguments})
        return {"reasoning": self.reasoning, "content": self.content, "tool_calls": calls}


class DeltaAccumulator:
    """Joins :class:`ParsedDelta` values into the :class:`ParseResult` they add up to."""

    def __init__(self) -> None:
        self._reasoning: list[str] = []
        self._content: list[str] = []
        # index -> [id, name, argument fragments]
        self._calls: dict[int, list[Any]] = {}

    def add(self, delta: ParsedDelta) -> None:
        """Take one delta into account."""
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        if delta.content:
            self._content.append(delta.content)
        for call in delta.tool_calls:
            entry = self._calls.setdefault(call.index, [None, None, []])
            if call.id is not None:
                entry[0] = call.id
            if call.name is not None:
                entry[1] = call.name
            if call.arguments:
                entry[2].append(call.arguments)

    @property
    def raw_reasoning(self) -> str:
        """All reasoning so far, unstripped."""
        return "".join(self._reasoning)

    @property
    def raw_content(self) -> str:
        """All content so far, unstripped."""
        return "".join(self._content)

    def result(self) -> ParseResult:
        """The message the deltas so far add up to."""
        calls = [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": "".join(fragments)}}
            for _, (call_id, name, fragments) in sorted(self._calls.items())
        ]
        reasoning = self.raw_reasoning.strip()
        content = self.raw_content.strip()
        return ParseResult(reasoning or None, content or None, calls)


def to_openai_delta(delta: ParsedDelta) -> dict[str, Any] | None:
    """The ``choices[0].delta`` of one streamed chunk; None when there is nothing to send.

    A call's first delta carries ``index``, ``id``, ``type`` and
    ``function.name`` (with its ``arguments`` so far, ``""`` in incremental
    mode); later ones carry ``index`` and ``function.arguments`` only.
    """
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
        out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for call in delta.tool_calls:
            if call.id is not None or call.name is not None:
                calls.append({"index": call.index, "id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            else:
                calls.append({"index": call.index, "function": {"arguments": call.arguments}})
        out["tool_calls"] = calls
    return out or None
