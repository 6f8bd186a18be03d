"""qwen3_coder, nemotron_v3, glm45/glm47 and minimax_m2: XML formats (format spec, section 5)."""

from __future__ import annotations

import pytest

from inference_engine_parsers.testing import factory, parse, result

WEATHER = {"city": "Oslo", "days": 2}

CODER_EXAMPLE = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                 "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


# ---------------------------------------------------------------- qwen3_coder


@pytest.mark.parametrize("tool", ["qwen3_coder", "nemotron_v3"])
def test_coder_spec_example(tool):
    assert parse(CODER_EXAMPLE, tool) == result(None, [("get_weather", WEATHER)])


def test_coder_multiple_calls_with_content_around():
    second = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    text = "Before.\n" + CODER_EXAMPLE + "\nBetween.\n" + second + "\nAfter."
    assert parse(text, "qwen3_coder") == result(
        "Before.\n\nBetween.\n\nAfter.", [("get_weather", WEATHER), ("get_time", {})])


def test_coder_function_without_wrapper_and_two_functions_in_one_wrapper():
    bare = "<function=get_time>\n</function>"
    assert parse(bare, "qwen3_coder") == result(None, [("get_time", {})])
    two = ("<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n"
           "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")
    assert parse(two, "qwen3_coder") == result(None, [("get_time", {}),
                                                     ("get_weather", {"city": "Oslo"})])


def test_coder_stray_closing_tag_after_an_unwrapped_function_is_dropped():
    # Qwen3-Coder sometimes leaves out the opening <tool_call> but still closes it
    text = ("I'll check.\n\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "</function>\n</tool_call>\nDone.")
    assert parse(text, "qwen3_coder") == result(
        "I'll check.\n\n\nDone.", [("get_weather", {"city": "Oslo"})])
    # only right after the function: elsewhere it stays content
    text = "<function=get_time>\n</function>\nok </tool_call>"
    assert parse(text, "qwen3_coder") == result("ok </tool_call>", [("get_time", {})])


def test_coder_missing_parameter_close_ends_at_next_parameter_or_function_end():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
            "<parameter=days>\n2\n</function>\n</tool_call>")
    assert parse(text, "qwen3_coder") == result(None, [("get_weather", WEATHER)])


@pytest.mark.parametrize("name", ["get weather", "", 'get"x', "get{x}", "get<x"])
def test_coder_bad_function_name_makes_the_block_content(name):
    text = f"<tool_call>\n<function={name}>\n</function>\n</tool_call>"
    assert parse(text, "qwen3_coder") == result(text)


def test_coder_truncated_before_function_end_is_content():
    text = "Let me.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    assert parse(text, "qwen3_coder") == result(text.strip())


def test_coder_value_keeps_lt_ampersands_blank_lines_and_unicode():
    value = "if a < b && c:\n\n    print('ø 🎉 <x>')"
    text = f"<function=get_weather>\n<parameter=city>\n{value}\n</parameter>\n</function>"
    assert parse(text, "qwen3_coder")["tool_calls"][0]["arguments"] == {"city": value}


def test_coder_removes_exactly_one_newline_each_side():
    text = "<function=get_weather>\n<parameter=city>\n\nOslo\n\n</parameter>\n</function>"
    assert parse(text, "qwen3_coder")["tool_calls"][0]["arguments"] == {"city": "\nOslo\n"}


def test_coder_unknown_tool_keeps_raw_strings():
    text = "<function=nope>\n<parameter=days>\n2\n</parameter>\n</function>"
    assert parse(text, "qwen3_coder") == result(None, [("nope", {"days": "2"})])


def test_nemotron_v3_spec_example_with_its_reasoning_parser():
    text = "Ask the tool.\n</think>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    assert parse(text, "nemotron_v3", "nemotron_v3") == result(
        None, [("get_time", {})], reasoning="Ask the tool.")


# ----------------------------------------------------------------------- GLM

GLM47_EXAMPLE = ("Need Oslo.</think><tool_call>get_weather<arg_key>city</arg_key>"
                 "<arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
                 "</tool_call>")
GLM45_LAYOUT = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")


def test_glm47_spec_example_with_glm45_reasoning():
    assert parse(GLM47_EXAMPLE, "glm47", "glm45") == result(
        None, [("get_weather", WEATHER)], reasoning="Need Oslo.")


@pytest.mark.parametrize("tool", ["glm45", "glm47"])
def test_glm_one_grammar_reads_both_layouts(tool):
    assert parse(GLM45_LAYOUT, tool) == result(None, [("get_weather", WEATHER)])
    assert parse(GLM47_EXAMPLE.split("</think>")[1], tool) == result(
        None, [("get_weather", WEATHER)])


def test_glm_zero_argument_calls_and_content_between():
    text = "A<tool_call>get_time</tool_call>B\n<tool_call>get_time\n</tool_call>C"
    assert parse(text, "glm47") == result("AB\nC", [("get_time", {}), ("get_time", {})])


def test_glm_unclosed_block_is_content():
    text = "Hi <tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    assert parse(text, "glm47") == result(text)


def test_glm_keys_are_stripped_and_literal_lt_in_values():
    text = ("<tool_call>get_weather<arg_key> city \n</arg_key><arg_value>a<b></arg_value>"
            "</tool_call>")
    assert parse(text, "glm47") == result(None, [("get_weather", {"city": "a<b>"})])


def test_glm_name_with_brace_is_not_a_call():
    text = '<tool_call>{"name": "get_time"}</tool_call>'
    assert parse(text, "glm45") == result(text)


# ----------------------------------------------------------------- minimax_m2

MINIMAX_EXAMPLE = ('Weather first.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                   '<parameter name="city">Oslo</parameter>\n<parameter name="days">2</parameter>\n'
                   "</invoke>\n</minimax:tool_call>")


def test_minimax_spec_example():
    assert parse(MINIMAX_EXAMPLE, "minimax_m2", "minimax_m2") == result(
        None, [("get_weather", WEATHER)], reasoning="Weather first.")


def test_minimax_several_invokes_quote_styles_and_indexes_continue_across_wrappers():
    text = ("<minimax:tool_call>\n<invoke name='get_time'>\n</invoke>\n"
            "<invoke name=get_weather>\n<parameter name=city>Oslo</parameter>\n</invoke>\n"
            "</minimax:tool_call>\nthen\n<minimax:tool_call>\n<invoke name=\"get_time\">\n"
            "</invoke>\n</minimax:tool_call>")
    pipeline = factory("minimax_m2").create()
    pipeline.feed(text)
    pipeline.finish()
    assert pipeline.result().simple() == result(
        "then", [("get_time", {}), ("get_weather", {"city": "Oslo"}), ("get_time", {})])


def test_minimax_unclosed_wrapper_with_complete_invokes_yields_them():
    text = '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n'
    assert parse(text, "minimax_m2") == result(None, [("get_time", {})])


def test_minimax_unfinished_invoke_is_content_but_earlier_ones_are_calls():
    tail = '<invoke name="get_weather">\n<parameter name="city">Os'
    text = '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n' + tail
    assert parse(text, "minimax_m2") == result(tail, [("get_time", {})])


def test_minimax_unknown_tool_and_values_with_markup():
    text = ('<minimax:tool_call><invoke name="nope"><parameter name="days"> 2 </parameter>'
            '<parameter name="html"><b>x</b></parameter></invoke></minimax:tool_call>')
    assert parse(text, "minimax_m2") == result(None, [("nope", {"days": "2", "html": "<b>x</b>"})])


@pytest.mark.parametrize("invoke", [
    '<invoke name="get_weather" description="Look up the weather.">',
    '<invoke description="Look up the weather." name="get_weather">',
    "<invoke name='get_weather' id=7 >",
    '<invoke  name = "get_weather"\n  kind="tool">',
])
@pytest.mark.parametrize("parameter", [
    '<parameter name="city" type="string">',
    '<parameter type="string" name="city">',
    "<parameter name=city type='str'>",
])
def test_minimax_other_attributes_are_ignored(invoke, parameter):
    text = (f"Go.\n<minimax:tool_call>\n{invoke}\n{parameter}Oslo</parameter>\n"
            '<parameter name="days" description="how many">2</parameter>\n</invoke>\n'
            "</minimax:tool_call>")
    assert parse(text, "minimax_m2") == result("Go.", [("get_weather", WEATHER)])


@pytest.mark.parametrize("invoke", [
    '<invoke description="no name">',             # no name attribute
    '<invoke name="">',                            # empty name
    '<invoke name="get_time" description="open>',  # a quote left open
    '<invoke name="get_time" hidden>',             # an attribute without a value
    '<invoke name="get_time"description="x">',     # no space between attributes
])
def test_minimax_malformed_invoke_tag_is_content(invoke):
    text = f"<minimax:tool_call>\n{invoke}\n</invoke>\n</minimax:tool_call>"
    assert parse(text, "minimax_m2") == result(text)
