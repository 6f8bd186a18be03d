"""Typing XML parameter values from the tool's JSON schema (format spec, section 4).

Each family has a *plan* per parameter: either the value streams as a JSON
string (:class:`StringValue`, character by character, with the family's
stripping and null words) or it is kept until complete and converted
(:class:`HeldValue`). Both write canonical JSON text (``json.dumps`` with
``ensure_ascii=False``) to ``out``.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "HeldValue",
    "StringValue",
    "coder_value",
    "glm_value",
    "minimax_value",
]

_encode = json.encoder.encode_basestring  # type: ignore[attr-defined]
_STRING_TYPES = ("string", "str", "text", "enum")


def _is_jsonable(value: Any) -> bool:
    """True if ``json.dumps`` writes ``value`` as standard JSON."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_jsonable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_jsonable(v) for k, v in value.items())
    return False


def _json_or_literal(text: str, *, use_json: bool = True) -> tuple[bool, Any]:
    """(True, value) from JSON, else a Python literal; (False, None) if neither fits."""
    if use_json:
        try:
            value = json.loads(text)
            if _is_jsonable(value):
                return True, value
        except (ValueError, RecursionError):
            pass
    try:
        value = ast.literal_eval(text)
        if _is_jsonable(value):
            return True, value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    return False, None


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class StringValue:
    """A value that becomes a JSON string (or ``null``), streamed as it comes.

    ``strip`` is ``"none"``, ``"newline"`` (drop one leading and one trailing
    ``\\n``) or ``"all"`` (``str.strip``). A value equal (any case) to one of
    ``null_words`` after stripping is written as ``null``, so the opening quote
    is held while the text could still become one.

    NOTE: the text that the trailing strip could still remove is held as a
    list of pieces and written once non-space text follows it, so a long run
    of whitespace costs linear work, not a re-strip per delta.
    """

    def __init__(self, out: Callable[[str], None], strip: str = "none",
                 null_words: tuple[str, ...] = ()) -> None:
        self._out = out
        self._strip = strip
        self._null_words = null_words
        self._is_lead_done = strip == "none"
        self._is_started = False
        # Before the opening quote: the text so far minus the held tail; it is
        # short, since the quote opens once it cannot be a null word.
        self._head = ""
        # The suffix the trailing strip may remove (pieces, joined when released).
        self._tail: list[str] = []

    def _split_tail(self, text: str) -> tuple[str, str]:
        """(text, "") or (body, suffix) where ``suffix`` is what the trailing strip removes."""
        if self._strip == "newline":
            return (text[:-1], "\n") if text.endswith("\n") else (text, "")
        if self._strip == "all":
            body = text.rstrip()
            return body, text[len(body):]
        return text, ""

    def feed(self, text: str) -> None:
        """Take the next piece of the raw value."""
        if not self._is_lead_done:
            if not text:
                return
            if self._strip == "newline":
                if text[0] == "\n":
                    text = text[1:]
            else:
                text = text.lstrip()
                if not text:
                    return
            self._is_lead_done = True
        if not text:
            return
        body, suffix = self._split_tail(text)
        if not body and self._strip == "all":
            self._tail.append(suffix)  # still only whitespace: keep holding
            return
        # Non-space text (or, for "newline", a second "\n") follows the held
        # tail, so the tail is part of the value after all.
        ready = "".join(self._tail) + body
        self._tail = [suffix] if suffix else []
        if ready:
            self._write(ready)

    def _write(self, text: str) -> None:
        if not self._is_started:
            self._head += text
            if self._null_words and self._could_be_null():
                return
            self._is_started = True
            text, self._head = self._head, ""
            self._out('"')
        self._out(_encode(text)[1:-1])

    def _could_be_null(self) -> bool:
        head = self._head.lower()
        return any(word.startswith(head) for word in self._null_words)

    def finish(self) -> None:
        """The raw value ended: write the rest (the held tail is stripped)."""
        if not self._is_started:
            if self._null_words and self._head.lower() in self._null_words:
                self._out("null")
                return
            self._out('"' + _encode(self._head)[1:-1])
        self._out('"')


class HeldValue:
    """A value kept until complete, then converted by ``convert(raw) -> JSON value``."""

    def __init__(self, out: Callable[[str], None], convert: Callable[[str], Any]) -> None:
        self._out = out
        self._convert = convert
        self._parts: list[str] = []

    def feed(self, text: str) -> None:
        """Take the next piece of the raw value."""
        self._parts.append(text)

    def finish(self) -> None:
        """The raw value ended: convert and write it."""
        self._out(_dump(self._convert("".join(self._parts))))


# --------------------------------------------------------------------------- #
# qwen3_coder / nemotron_v3
# --------------------------------------------------------------------------- #


def _coder_type(schema: dict[str, Any]) -> tuple[str, bool]:
    """(lower-case type, nullable) from ``type`` or the first non-null ``anyOf`` branch."""
    nullable = False
    type_value = schema.get("type")
    if type_value is None and isinstance(schema.get("anyOf"), list):
        for branch in schema["anyOf"]:
            branch_type = branch.get("type") if isinstance(branch, dict) else None
            if branch_type == "null":
                nullable = True
            elif type_value is None and branch_type is not None:
                type_value = branch_type
    if isinstance(type_value, list):
        nullable = nullable or "null" in type_value
        type_value = next((t for t in type_value if t != "null"), None)
    if type_value is None:
        return "string", nullable
    return str(type_value).strip().lower(), nullable


def _coder_convert(value: str, type_name: str) -> Any:
    if value.lower() in ("null", "none"):
        return None
    if type_name.startswith("int"):
        try:
            return int(value)
        except ValueError:
            return value
    if type_name.startswith("num") or type_name.startswith("float"):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if type_name in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if type_name in ("object", "array"):
        ok, parsed = _json_or_literal(value)
        if ok and isinstance(parsed, str):
            # A JSON string holding the container (a template that wrote
            # json.dumps(str(obj))) is decoded once more, as vLLM does.
            is_inner, inner = _json_or_literal(parsed)
            if is_inner and isinstance(inner, (dict, list)):
                return inner
        return parsed if ok else value
    ok, parsed = _json_or_literal(value, use_json=False)
    return parsed if ok else value


def coder_value(out: Callable[[str], None], schema: dict[str, Any] | None) -> Any:
    """The value plan of a qwen3_coder parameter (``schema`` None: not in the schema)."""
    if schema is None:
        return StringValue(out, "newline")
    type_name, nullable = _coder_type(schema)
    if type_name in _STRING_TYPES:
        return StringValue(out, "newline", ("null", "none") if nullable else ())

    def convert(raw: str) -> Any:
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        return _coder_convert(raw, type_name)

    return HeldValue(out, convert)


# --------------------------------------------------------------------------- #
# glm45 / glm47
# --------------------------------------------------------------------------- #


def _glm_convert(raw: str) -> Any:
    text = raw.strip()
    ok, parsed = _json_or_literal(text)
    return parsed if ok else text


def glm_value(out: Callable[[str], None], schema: dict[str, Any] | None) -> Any:
    """The value plan of a GLM argument: verbatim for ``type: string``, else converted."""
    if schema is not None and schema.get("type") == "string":
        return StringValue(out, "none")
    return HeldValue(out, _glm_convert)


# --------------------------------------------------------------------------- #
# minimax_m2
# --------------------------------------------------------------------------- #

# "null" is null for every type; "none"/"nil" only where no string is allowed, since
# they can be real values ("none" in an enum of strings); vLLM PR #39599.
_MINIMAX_NULLS = ("null",)
_MINIMAX_NULL_WORDS = ("null", "none", "nil")
_MINIMAX_STRING_TYPES = {"string", "str", "text", "enum"}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def _minimax_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    type_value = schema.get("type")
    if isinstance(type_value, str):
        types.add(type_value.lower())
    elif isinstance(type_value, list):
        types.update(t.lower() for t in type_value if isinstance(t, str))
    if isinstance(schema.get("enum"), list):
        for item in schema["enum"]:
            if item is None:
                types.add("null")
                continue
            types.update(next(([name] for cls, name in _ENUM_TYPES if isinstance(item, cls)), []))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for branch in schema[key]:
                types |= _minimax_types(branch)
    return types


def _minimax_convert(raw: str, types: set[str]) -> Any:
    value = raw.strip()
    nulls = _MINIMAX_NULLS if types & _MINIMAX_STRING_TYPES else _MINIMAX_NULL_WORDS
    if value.lower() in nulls:
        return None
    if types & {"integer", "int"}:
        try:
            return int(value)
        except ValueError:
            pass
    if types & {"number", "float"}:
        try:
            number = float(value)
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
        except ValueError:
            pass
    if types & {"boolean", "bool"}:
        lowered = value.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
    for name, cls in (("object", dict), ("array", list)):
        if name in types:
            try:
                parsed = json.loads(value)
                if isinstance(parsed, cls) and _is_jsonable(parsed):
                    return parsed
            except (ValueError, RecursionError):
                pass
    if types & _MINIMAX_STRING_TYPES:
        return value
    try:
        parsed = json.loads(value)
        if _is_jsonable(parsed):
            return parsed
    except (ValueError, RecursionError):
        pass
    return value


def minimax_value(out: Callable[[str], None], schema: dict[str, Any] | None) -> Any:
    """The value plan of a MiniMax parameter: stripped, null words, types in priority order."""
    types = _minimax_types(schema) if schema is not None else set()
    if not types or types <= _MINIMAX_STRING_TYPES:
        return StringValue(out, "all", _MINIMAX_NULLS)
    return HeldValue(out, lambda raw: _minimax_convert(raw, types))
