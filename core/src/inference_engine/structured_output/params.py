"""What a request constrains its output to: vLLM's ``StructuredOutputsParams``.

Exactly one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``,
``structural_tag`` is set.
The grammar is compiled by xgrammar (see :mod:`.compiler`), once per distinct
:meth:`StructuredOutputsParams.cache_key`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsParams"]

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint, named as in vLLM so users can switch.

    Raises:
        ValueError: none or several kinds set, or a value of the wrong type (names it).
    """

    # A JSON schema (dict or JSON text): the output is one JSON value valid under it.
    json: dict[str, Any] | str | None = None
    # Any JSON object (OpenAI's response_format {"type": "json_object"}).
    json_object: bool | None = None
    # A regular expression the whole output matches.
    regex: str | None = None
    # The output is exactly one of these strings.
    choice: list[str] | None = None
    # An EBNF grammar (xgrammar's GBNF dialect, root rule ``root``).
    grammar: str | None = None
    # An xgrammar structural tag (dict or JSON text): free text with constrained regions
    # opened by trigger strings, e.g. tool calls (``{"type": "structural_tag", "format":
    # {"type": "triggered_tags", ...}}``).
    structural_tag: dict[str, Any] | str | None = None
    # JSON without free whitespace between tokens (compact separators); default: any.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        set_kinds = [k for k in _KINDS if getattr(self, k) is not None]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, "
                             f"choice, grammar; got {set_kinds or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = json.loads(self.structural_tag)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: "
                                 f"{exc}") from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise ValueError("structured_outputs.structural_tag must be an object")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object, got "
                             f"{type(self.json).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true, got "
                             f"{self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for constraints that compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "choice", "structural_tag"):
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        else:
            text = str(value)
        return kind, text, self.disable_any_whitespace

    def choice_grammar(self) -> str:
        """EBNF for ``choice``: one alternative per string, each a JSON-escaped literal."""
        assert self.choice is not None
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
