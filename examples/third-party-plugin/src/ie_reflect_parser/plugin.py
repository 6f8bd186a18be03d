"""Registers the ``reflect`` reasoning parser and the ``reflect_calls`` tool parser.

Targets are strings: nothing is imported until a parser is used.
"""

from __future__ import annotations

from inference_engine import Spec, hookimpl


@hookimpl
def ie_register_reasoning_parsers() -> list[Spec]:
    return [
        Spec(
            "reflect",
            "ie_reflect_parser.parser:ReflectReasoningParser",
            "reasoning wrapped in <reflect>...</reflect>",
        )
    ]


@hookimpl
def ie_register_tool_parsers() -> list[Spec]:
    return [
        Spec(
            "reflect_calls",
            "ie_reflect_parser.tool_parser:ReflectCallsToolParser",
            '<call name="NAME">{json arguments}</call>',
        )
    ]
