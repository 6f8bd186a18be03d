"""qwen3, nemotron_v2 and deepseek_v31: JSON-argument formats (format spec, section 5)."""

from __future__ import annotations

import pytest

from inference_engine_parsers.testing import exact, factory, parse, result

WEATHER = {"city": "Oslo", "days": 2}


def _qwen3_block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# ----------------------------------------------------------------------- qwen3


def test_qwen3_spec_example():
    text = ("I'll check.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>')
    assert parse(text, "qwen3") == result("I'll check.", [("get_weather", WEATHER)])


def test_qwen3_multiple_calls_and_content_before_between_after():
    text = ("A\n" + _qwen3_block("get_weather", '{"city": "Oslo"}') + "\nB\n"
            + _qwen3_block("get_time", "{}") + "\nC")
    assert parse(text, "qwen3") == result(
        "A\n\nB\n\nC", [("get_weather", {"city": "Oslo"}), ("get_time", {})])


def test_qwen3_nested_unicode_and_no_schema_coercion():
    args = '{"q": {"deep": [1, {"x": "ø"}]}, "emoji": "🎉", "days": "3", "esc": "a\\"b\\n"}'
    parsed = parse(_qwen3_block("get_weather", args), "qwen3")
    assert parsed["tool_calls"] == [{"name": "get_weather", "arguments": {
        "q": {"deep": [1, {"x": "ø"}]}, "emoji": "🎉", "days": "3", "esc": 'a"b\n'}}]
    # the JSON text is sent in canonical json.dumps form
    text = _qwen3_block("get_weather", '{ "b" :[ 1 ,2 ] }')
    assert exact(factory("qwen3").parse(text))[2] == [("get_weather", '{"b": [1, 2]}')]


def test_qwen3_tool_call_marker_inside_a_json_string_is_data():
    text = _qwen3_block("get_weather", '{"city": "<tool_call></tool_call>"}')
    assert parse(text, "qwen3") == result(None, [("get_weather",
                                                   {"city": "<tool_call></tool_call>"})])


def test_qwen3_missing_closing_tag_is_fine_when_json_is_complete():
    text = 'x <tool_call>\n{"name": "get_time", "arguments": {}}'
    assert parse(text, "qwen3") == result("x", [("get_time", {})])


def test_qwen3_body_not_starting_with_brace_is_content():
    text = "<tool_call>\nget_time()\n</tool_call>"
    assert parse(text, "qwen3") == result(text)


def test_qwen3_each_block_stands_alone():
    bad = '<tool_call>\n{"name": "get_time", "arguments": {"a": 1,}}\n</tool_call>'
    text = _qwen3_block("get_weather", '{"city": "Oslo"}') + "\n" + bad + "\n" + \
        _qwen3_block("get_time", "{}")
    assert parse(text, "qwen3") == result(bad, [("get_weather", {"city": "Oslo"}),
                                               ("get_time", {})])


def test_qwen3_truncated_call_is_content_from_the_opener():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    assert parse(text, "qwen3") == result(text)


def test_qwen3_unknown_tool_is_emitted_and_empty_arguments_kept():
    text = _qwen3_block("not_a_tool", "{}")
    assert parse(text, "qwen3") == result(None, [("not_a_tool", {})])
    # a call without "arguments" has empty arguments
    assert parse('<tool_call>{"name": "get_time"}</tool_call>', "qwen3") == \
        result(None, [("get_time", {})])


def test_qwen3_literal_less_than_in_content():
    text = "if a < b and <b>bold</b> <tool_ then </tool_call> ok"
    assert parse(text, "qwen3") == result(text)


def test_qwen3_reasoning_plus_calls():
    text = "<think>Let me call.</think>\n\n" + _qwen3_block("get_weather", '{"city": "Oslo"}')
    assert parse(text, "qwen3", "qwen3") == result(
        None, [("get_weather", {"city": "Oslo"})], reasoning="Let me call.")


# ---------------------------------------------------------------- nemotron_v2


def test_nemotron_v2_spec_example():
    text = ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]</TOOLCALL>')
    assert parse(text, "nemotron_v2") == result(
        None, [("get_weather", {"city": "Oslo"}), ("get_time", {})])


def test_nemotron_v2_bare_object_and_string_arguments():
    text = ('Here <TOOLCALL>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
            '</TOOLCALL> done')
    assert parse(text, "nemotron_v2") == result("Here  done", [("get_weather", {"city": "Oslo"})])


def test_nemotron_v2_one_bad_element_makes_the_block_content():
    text = ('<TOOLCALL>[{"name": "get_time", "arguments": {}}, '
            '{"arguments": {}}]</TOOLCALL>')
    assert parse(text, "nemotron_v2") == result(text)
    # arguments that are a string not holding an object
    bad = '<TOOLCALL>[{"name": "get_time", "arguments": "not json"}]</TOOLCALL>'
    assert parse(bad, "nemotron_v2") == result(bad)


def test_nemotron_v2_truncated_array_is_content():
    text = 'ok <TOOLCALL>[{"name": "get_time", "arguments": {}}, {"name": "get_we'
    assert parse(text, "nemotron_v2") == result(text)


def test_nemotron_v2_blocks_number_calls_across_blocks():
    text = ('<TOOLCALL>[{"name": "a", "arguments": {}}]</TOOLCALL> and '
            '<TOOLCALL>[{"name": "b", "arguments": {"x": [1, 2]}}]</TOOLCALL>')
    pipeline = factory("nemotron_v2").create()
    pipeline.feed(text)
    pipeline.finish()
    calls = pipeline.result().tool_calls
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[0]["id"] != calls[1]["id"]
    assert pipeline.result().content == "and"


# --------------------------------------------------------------- deepseek_v31

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def test_deepseek_markers_use_fullwidth_bars_and_lower_blocks():
    assert "\uff5c" in B and "\u2581" in B


def test_deepseek_v31_spec_example():
    text = f'Checking.{B}{CB}get_weather{SEP}{{"city": "Oslo"}}{CE}{E}'
    assert parse(text, "deepseek_v31") == result("Checking.", [("get_weather", {"city": "Oslo"})])


def test_deepseek_v31_multiple_calls_raw_newlines_and_content_after():
    text = (f'{B}{CB}get_weather{SEP}{{\n  "city": "Oslo",\n  "days": 2\n}}{CE}'
            f'{CB}get_time{SEP}{{}}{CE}{E}\nDone.')
    assert parse(text, "deepseek_v31") == result(
        "Done.", [("get_weather", WEATHER), ("get_time", {})])


def test_deepseek_v31_truncated_and_malformed_are_content():
    truncated = f'Hm {B}{CB}get_weather{SEP}{{"city": "Os'
    assert parse(truncated, "deepseek_v31") == result(truncated)
    malformed = f'{B}{CB}get_weather{SEP}city=Oslo{CE}{E}'
    assert parse(malformed, "deepseek_v31") == result(malformed)


def test_deepseek_v31_with_thinking_uses_the_r1_split():
    text = f'Plan it.</think>Checking.{B}{CB}get_time{SEP}{{}}{CE}{E}'
    assert parse(text, "deepseek_v31", "deepseek_v3", enable_thinking=True) == \
        result("Checking.", [("get_time", {})], reasoning="Plan it.")
    # thinking off (deepseek_v3's default): no split at all
    assert parse("a</think>b", "deepseek_v31", "deepseek_v3") == result("a</think>b")


def test_qwen3_string_encoded_arguments_are_decoded():
    text = _qwen3_block("get_weather", '"{\\"city\\": \\"Oslo\\", \\"days\\": 2}"')
    assert parse(text, "qwen3") == result(None, [("get_weather", WEATHER)])
    # sent as canonical JSON, like object arguments
    text = _qwen3_block("get_time", '" { \\"b\\" :[1,2] } "')
    assert exact(factory("qwen3").parse(text))[2] == [("get_time", '{"b": [1, 2]}')]
    # before the name, too
    text = '<tool_call>{"arguments": "{\\"param\\": \\"max_connections\\"}", "name": "f"}'
    assert parse(text, "qwen3") == result(None, [("f", {"param": "max_connections"})])


@pytest.mark.parametrize("arguments", ['"not json"', '"[1, 2]"', '"{\\"a\\": 1"', '"3"', "3"])
def test_qwen3_string_arguments_not_holding_an_object_are_content(arguments):
    text = _qwen3_block("get_time", arguments)
    assert parse(text, "qwen3") == result(text)
