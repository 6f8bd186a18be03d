"""Registers the ``reflect`` reasoning parser; imports nothing heavy."""

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
