"""Reasoning parsers (format spec, section 3): defaults, switches, implicit end."""

from __future__ import annotations

import pytest

from inference_engine.parsing import thinking_from_kwargs
from inference_engine_parsers.testing import parse, result

ON_BY_DEFAULT = ["qwen3", "glm45", "nemotron_v3"]
ALWAYS_ON = ["minimax_m2", "deepseek_r1"]


@pytest.mark.parametrize("reasoning", ON_BY_DEFAULT + ALWAYS_ON)
def test_starts_inside_reasoning_and_drops_a_leading_think(reasoning):
    assert parse("a</think>b", None, reasoning) == result("b", reasoning="a")
    assert parse("  <think>\na\n</think>\n\nb", None, reasoning) == result("b", reasoning="a")
    # no </think>: the output was cut, everything is reasoning
    assert parse("<think>still thinking", None, reasoning) == result(reasoning="still thinking")
    # only the first </think> ends reasoning (MiniMax-M2 then drops later ones, tested below)
    if reasoning != "minimax_m2":
        assert parse("a</think>b</think>c", None, reasoning) == \
            result("b</think>c", reasoning="a")


@pytest.mark.parametrize("reasoning", ["qwen3", "glm45"])
def test_thinking_off_makes_everything_content(reasoning):
    assert parse("a</think>b", None, reasoning, enable_thinking=False) == result("a</think>b")


def test_glm_and_deepseek_thinking_kwarg_is_read():
    off = thinking_from_kwargs({"thinking": False})
    assert parse("a</think>b", None, "glm45", enable_thinking=off) == result("a</think>b")
    on = thinking_from_kwargs({"thinking": True})
    assert parse("a</think>b", None, "deepseek_v3", enable_thinking=on) == \
        result("b", reasoning="a")


@pytest.mark.parametrize("reasoning", ALWAYS_ON)
def test_always_on_ignores_the_switch(reasoning):
    assert parse("a</think>b", None, reasoning, enable_thinking=False) == \
        result("b", reasoning="a")


@pytest.mark.parametrize(("text", "content"), [
    ("r</think>A</think>B", "AB"),
    ("r</think>A</think></think>B</think>", "AB"),
    ("r</think>A</thinkB</think", "A</thinkB</think"),   # partial markers are text
    ("r</think>A</thi</think>nk>B", "A</think>B"),       # removal does not re-scan
    ("r</think>A<think>B", "A<think>B"),                  # only the end marker goes
])
def test_minimax_removes_every_later_think_end_from_content(text, content):
    assert parse(text, None, "minimax_m2") == result(content, reasoning="r")


def test_minimax_removes_think_end_after_an_implicit_end_and_after_calls():
    call = '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'
    text = f"r\n{call}\n</think>\nA</think>B"
    assert parse(text, "minimax_m2", "minimax_m2") == result(
        "AB", [("get_time", {})], reasoning="r")
    text = f"r</think>{call}</think>done"
    assert parse(text, "minimax_m2", "minimax_m2") == result(
        "done", [("get_time", {})], reasoning="r")


def test_minimax_keeps_think_end_inside_a_tool_call_wrapper():
    text = ('r</think>A</think><minimax:tool_call><invoke name="get_weather">'
            '<parameter name="city">x</think>y</parameter></invoke>'
            "</minimax:tool_call>B</think>C")
    assert parse(text, "minimax_m2", "minimax_m2") == result(
        "ABC", [("get_weather", {"city": "x</think>y"})], reasoning="r")
    # without a tool parser the wrapper is plain content, kept as written
    assert parse("r</think><minimax:tool_call></think></minimax:tool_call></think>",
                 None, "minimax_m2") == \
        result("<minimax:tool_call></think></minimax:tool_call>", reasoning="r")


def test_other_families_keep_a_later_think_end_in_content():
    assert parse("r</think>A</think>B", None, "qwen3") == result("A</think>B", reasoning="r")
    assert parse("r</think>A</think>B", None, "minimax_m2_append_think") == \
        result("<think>r</think>A</think>B")


def test_deepseek_v3_is_off_by_default():
    assert parse("a</think>b", None, "deepseek_v3") == result("a</think>b")
    assert parse("<think>a</think>b", None, "deepseek_v3", enable_thinking=True) == \
        result("b", reasoning="a")


def test_minimax_append_think_keeps_everything_as_content_and_still_parses_tools():
    text = ('a</think>b<minimax:tool_call><invoke name="get_time"></invoke>'
            "</minimax:tool_call>")
    assert parse(text, "minimax_m2", "minimax_m2_append_think") == result(
        "<think>a</think>b", [("get_time", {})])


def test_nemotron_v3_swaps_reasoning_into_content_when_off_and_empty():
    assert parse("The answer.", None, "nemotron_v3", enable_thinking=False) == \
        result("The answer.")
    assert parse("why</think>answer", None, "nemotron_v3", enable_thinking=False) == \
        result("answer", reasoning="why")
    assert parse("why</think>\n", None, "nemotron_v3", enable_thinking=False) == \
        result("why")
    # thinking on (the default): no swap
    assert parse("The answer.", None, "nemotron_v3") == result(reasoning="The answer.")


IMPLICIT = [
    ("qwen3", "qwen3", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("qwen3_coder", "qwen3", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
    ("nemotron_v3", "nemotron_v3", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
    ("glm45", "glm45", "<tool_call>get_time\n</tool_call>"),
    ("glm47", "glm45", "<tool_call>get_time</tool_call>"),
    ("minimax_m2", "minimax_m2",
     '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'),
    ("nemotron_v2", "deepseek_r1", '<TOOLCALL>[{"name": "get_time", "arguments": {}}]</TOOLCALL>'),
    ("deepseek_v31", "deepseek_r1",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
]


@pytest.mark.parametrize(("tool", "reasoning", "call"), IMPLICIT)
def test_a_call_inside_reasoning_ends_it_and_is_not_lost(tool, reasoning, call):
    text = f"I should check the time.\n{call}\n</think>\n\nIt is noon."
    assert parse(text, tool, reasoning, enable_thinking=True) == result(
        "It is noon.", [("get_time", {})], reasoning="I should check the time.")


def test_qwen3_tool_call_tag_not_followed_by_json_stays_reasoning():
    reasoning = "I could emit <tool_call> tags."
    assert parse(reasoning + "</think>Done", "qwen3", "qwen3") == \
        result("Done", reasoning=reasoning)
    reasoning = "Use <tool_call>\n<function=x> maybe."
    assert parse(reasoning + "</think>Done", "qwen3", "qwen3") == \
        result("Done", reasoning=reasoning)


def test_third_party_reasoning_parser_works_in_the_pipeline():
    text = ('Sure.<reflect>hmm</reflect><tool_call>\n{"name": "get_time", "arguments": {}}\n'
            "</tool_call>")
    assert parse(text, "qwen3", "reflect") == result("Sure.", [("get_time", {})], reasoning="hmm")
