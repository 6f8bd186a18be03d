"""Constraints that start after a reasoning section, as vLLM applies structured outputs
only once the reasoning parser's end marker has been written.

The wrap is itself a grammar (an xgrammar structural tag): free text up to the end
marker (``</think>``), optional whitespace, then the request's constraint. Text inside
the reasoning may be kept from containing given strings (a tool call's trigger, so a
forced call cannot be written, unconstrained, inside the reasoning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference_engine.structured_output.params import StructuredOutputsParams

__all__ = ["after_reasoning"]


def after_reasoning(constraint: StructuredOutputsParams, end_marker: str,
                    excludes: Sequence[str] = ()) -> StructuredOutputsParams:
    """``constraint`` applied after ``end_marker``; returned unchanged when it already
    leaves free text before its constrained part (triggered tags without ``at_least_one``)
    or is a structural tag in xgrammar's legacy form."""
    body = _format_of(constraint)
    if body is None:
        return constraint
    reasoning = {"type": "tag", "begin": "", "end": end_marker,
                 "content": {"type": "any_text", "excludes": list(excludes)}}
    sequence = {"type": "sequence",
                "elements": [reasoning, {"type": "regex", "pattern": "[ \\n\\t\\r]*"}, body]}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                                   "format": sequence})


def _format_of(constraint: StructuredOutputsParams) -> dict[str, Any] | None:
    """The constraint as a structural-tag format, or None when it is not to be wrapped."""
    from inference_engine.structured_output.compiler import json_schema_ebnf

    kind = constraint.kind
    if kind == "structural_tag":
        body = constraint.structural_tag.get("format")
        if not isinstance(body, dict) or (body.get("type") == "triggered_tags"
                                          and not body.get("at_least_one")):
            return None
        return body
    if kind == "regex":
        return {"type": "regex", "pattern": constraint.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": constraint.grammar}
    if kind == "choice":
        return {"type": "grammar", "grammar": constraint.choice_grammar()}
    any_whitespace = not constraint.disable_any_whitespace
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        schema = {} if constraint.json is True else constraint.json
    return {"type": "grammar", "grammar": json_schema_ebnf(schema, any_whitespace)}
