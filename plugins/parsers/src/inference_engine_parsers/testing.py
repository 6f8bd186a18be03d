"""Test helpers for parsers: parse or stream an output through registered parser names.

Used by this distribution's tests and handy for third-party parser authors:
no model and no tokenizer are needed (the parsers are text-level).
"""

from __future__ import annotations

import json

from inference_engine.parsing import PipelineFactory

__all__ = ["TOOLS", "args_text", "exact", "factory", "parse", "result", "stream"]

# The spec's example tool plus a few typed parameters for section 4.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
        }}}},
    {"type": "function", "function": {
        "name": "typed",
        "parameters": {"type": "object", "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "o": {"type": "object"},
            "a": {"type": "array"},
            "ns": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "ni": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
            "u": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
            "e": {"enum": ["x", 1]},
            "es": {"enum": ["none", "yes", "no"]},
        }}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def factory(tool: str | None, reasoning: str | None = None,
            mode: str = "incremental") -> PipelineFactory:
    return PipelineFactory(tool, reasoning, mode)


def parse(text: str, tool: str | None, reasoning: str | None = None, *,
          tools=TOOLS, enable_thinking=None) -> dict:
    """Non-streaming result as {"reasoning", "content", "tool_calls": [{"name", "arguments"}]}."""
    return factory(tool, reasoning).parse(text, tools=tools,
                                          enable_thinking=enable_thinking).simple()


def stream(text: str, tool: str | None, reasoning: str | None = None, *, cuts=(),
           mode: str = "incremental", tools=TOOLS, enable_thinking=None):
    """(pipeline, deltas) after feeding ``text`` split at ``cuts``."""
    pipeline = factory(tool, reasoning, mode).create(tools=tools, enable_thinking=enable_thinking)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    deltas = [pipeline.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    deltas.append(pipeline.finish())
    return pipeline, deltas


def result(content=None, calls=(), reasoning=None) -> dict:
    """The expected simple() dict; ``calls`` as (name, arguments) pairs."""
    return {"reasoning": reasoning, "content": content,
            "tool_calls": [{"name": n, "arguments": a} for n, a in calls]}


def exact(parsed) -> tuple:
    """A ParseResult with argument texts kept as strings (for exact comparisons)."""
    return (parsed.reasoning, parsed.content,
            [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls])


def args_text(value) -> str:
    """The canonical arguments text of ``value`` (what the parsers send)."""
    return json.dumps(value, ensure_ascii=False)
