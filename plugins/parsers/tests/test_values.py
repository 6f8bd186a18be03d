"""Typing XML argument values from the tool schema (format spec, section 4)."""

from __future__ import annotations

import pytest

from inference_engine_parsers.testing import parse


def _coder(param: str, value: str, tool: str = "typed"):
    text = f"<function={tool}>\n<parameter={param}>\n{value}\n</parameter>\n</function>"
    return parse(text, "qwen3_coder")["tool_calls"][0]["arguments"][param]


def _glm(param: str, value: str, tool: str = "typed"):
    text = f"<tool_call>{tool}<arg_key>{param}</arg_key><arg_value>{value}</arg_value></tool_call>"
    return parse(text, "glm47")["tool_calls"][0]["arguments"][param]


def _minimax(param: str, value: str, tool: str = "typed"):
    text = (f'<minimax:tool_call><invoke name="{tool}"><parameter name="{param}">{value}'
            "</parameter></invoke></minimax:tool_call>")
    return parse(text, "minimax_m2")["tool_calls"][0]["arguments"][param]


@pytest.mark.parametrize(("param", "value", "expected"), [
    ("zzz", "null", "null"),        # not in the schema: raw string
    ("s", "null", "null"),          # string: raw text even when "null"
    ("s", " 12 ", " 12 "),
    ("ns", "null", None),           # nullable (anyOf with null) and null/None, any case
    ("ns", "NULL", None),
    ("ns", "None", None),
    ("ns", "text", "text"),
    ("i", "12", 12),
    ("i", "1.5", "1.5"),            # int() fails: raw string
    ("i", "null", None),            # other types: null/None is null
    ("n", "21.0", 21),              # float, written as an int when whole
    ("n", "2.5", 2.5),
    ("n", "abc", "abc"),
    ("b", "true", True),
    ("b", "TRUE", True),
    ("b", "yes", False),            # true only for "true"
    ("b", "1", False),
    ("o", '{"k": [1, {"x": null}]}', {"k": [1, {"x": None}]}),
    ("o", "{'k': 1}", {"k": 1}),    # Python-literal fallback
    ("o", "nope", "nope"),
    ("a", "['a']", ["a"]),
    ("o", '"{\'k\': 1, \'n\': [2]}"', {"k": 1, "n": [2]}),  # JSON string holding a repr
    ("a", '"[1, \\"x\\"]"', [1, "x"]),                  # JSON string holding JSON
    ("o", '"just text"', "just text"),                     # a string holding no container
    ("ni", "7", 7),                 # first non-null anyOf branch
    ("ni", "None", None),
    ("e", "1", "1"),                # enum without type: string
])
def test_qwen3_coder_types(param, value, expected):
    assert _coder(param, value) == expected


def test_qwen3_coder_unknown_tool_keeps_strings():
    assert _coder("i", "12", tool="unknown") == "12"


@pytest.mark.parametrize(("param", "value", "expected"), [
    ("s", " Oslo \n", " Oslo \n"),  # type exactly string: verbatim, no stripping
    ("s", "12", "12"),
    ("i", " 12 ", 12),              # otherwise strip, then JSON
    ("zz", "12", 12),               # unknown keys too
    ("zz", "true", True),
    ("zz", "[1, 2]", [1, 2]),
    ("zz", "{'a': 1}", {"a": 1}),   # then a Python literal
    ("zz", " plain text ", "plain text"),  # else the stripped text
    ("ns", "null", None),           # anyOf is not exactly string
    ("i", '"abc"', "abc"),
])
def test_glm_types(param, value, expected):
    assert _glm(param, value) == expected


@pytest.mark.parametrize(("param", "value", "expected"), [
    ("s", " Oslo ", "Oslo"),        # stripped
    ("s", "null", None),            # null (any case) is null for every type, strings included
    ("s", " NULL\n", None),
    ("s", "nullable", "nullable"),
    ("i", "12", 12),
    ("i", "1.5", 1.5),              # no integer: nothing fits, JSON
    ("n", "21.0", 21),
    ("n", "2.5", 2.5),
    ("b", "yes", True),
    ("b", "on", True),
    ("b", "1", True),
    ("b", "off", False),
    ("b", "0", False),
    ("b", "maybe", "maybe"),        # nothing fits, not JSON: raw text
    ("o", '{"k": 1}', {"k": 1}),
    ("a", '[1, "x"]', [1, "x"]),
    ("u", "5", 5),                  # oneOf [integer, string]: integer first
    ("u", "abc", "abc"),
    ("e", "1", 1),                  # enum ["x", 1] gives string and integer
    ("e", "x", "x"),
    ("zz", "12", "12"),             # not in the schema: string
])
def test_minimax_types(param, value, expected):
    assert _minimax(param, value) == expected


@pytest.mark.parametrize(("param", "value", "expected"), [
    # none/nil stay text where the schema allows a string (vLLM PR #39599)...
    ("s", "none", "none"),
    ("s", " NIL ", "NIL"),
    ("es", "none", "none"),         # a valid enum value
    ("e", "nil", "nil"),            # enum ["x", 1]: a string is allowed
    ("ns", "None", "None"),         # anyOf [string, null]
    ("u", "none", "none"),          # oneOf [integer, string]
    ("zz", "none", "none"),         # not in the schema: string
    ("zz", "Null", None),           # ...null is null everywhere
    ("es", "null", None),
    ("u", "null", None),
    # ...and are null where no string is allowed
    ("i", "none", None),
    ("n", "nil", None),
    ("b", "None", None),
    ("o", "nil", None),
    ("a", "none", None),
    ("ni", "NIL", None),
])
def test_minimax_none_and_nil_are_text_when_a_string_is_allowed(param, value, expected):
    assert _minimax(param, value) == expected


def test_json_formats_are_not_coerced():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"days": "3"}}\n</tool_call>'
    assert parse(text, "qwen3")["tool_calls"][0]["arguments"] == {"days": "3"}
    text = '<TOOLCALL>[{"name": "get_weather", "arguments": {"days": "3"}}]</TOOLCALL>'
    assert parse(text, "nemotron_v2")["tool_calls"][0]["arguments"] == {"days": "3"}
