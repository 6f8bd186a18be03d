"""ParserPipeline over small in-test parsers: composition, delivery modes, OpenAI shapes."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_engine.interfaces.parsers import CallOpener, ParsedDelta, ToolCallDelta
from inference_engine.parsing import (
    ParserPipeline,
    PipelineFactory,
    StreamingToolParser,
    ThinkReasoningParser,
    check_tool_choice,
    default_parsers,
    json_value,
    match,
    match_after_ws,
    peek,
    read_until_char,
    run_parse,
    thinking_from_kwargs,
    to_openai_delta,
)

_NAME_STOP = re.compile(r"[\s{<>]")


class BracketToolParser(StreamingToolParser):
    """Test grammar: ``[[NAME {json}]]``; a call counts once its JSON closes."""

    openers = ("[[",)
    call_openers = (CallOpener("[[", ""),)

    def parse_block(self, r, opener):
        name = yield from read_until_char(r, _NAME_STOP)
        if not name or not (yield from match(r, " ")):
            return None
        self.begin_call(name)
        if (yield from peek(r)) != "{":
            return None
        if not (yield from json_value(r, self.call_args)):
            return None
        self.commit()
        if (yield from match_after_ws(r, "]]")):
            self.commit()
        return None


class OffByDefaultThink(ThinkReasoningParser):
    thinking_default = False


class SwapThink(ThinkReasoningParser):
    swap_when_off = True


class _Registry:
    """Duck-typed registry: PipelineFactory only calls resolve(kind, name)."""

    classes = {("tool_parsers", "bracket"): BracketToolParser,
               ("reasoning_parsers", "think"): ThinkReasoningParser,
               ("reasoning_parsers", "think_off"): OffByDefaultThink,
               ("reasoning_parsers", "swap"): SwapThink}

    def resolve(self, kind, name):
        return self.classes[(kind, name)]


REGISTRY = _Registry()


def _factory(tool="bracket", reasoning="think", mode="incremental"):
    return PipelineFactory(tool, reasoning, mode, registry=REGISTRY)


def _stream(pipeline: ParserPipeline, text: str, cuts=()):
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    deltas = [pipeline.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    deltas.append(pipeline.finish())
    return deltas


def _calls(result):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in result.tool_calls]


SAMPLE = 'plan [a] more</think>Hi [[get {"x": [1, "]]"]}]] mid [[bad {"x": ]] end'
COMPLETE = 'plan</think>Hi [[get {"x": [1, "]]"]}]] mid [[f {"a": "b\\u00e9"}]] <[ end'


def test_reasoning_then_calls_then_content():
    result = _factory().parse(SAMPLE)
    assert result.reasoning == "plan [a] more"
    assert result.content == "Hi  mid [[bad {\"x\": ]] end"
    assert _calls(result) == [("get", {"x": [1, "]]"]})]
    assert result.finish_reason == "tool_calls"


def test_implicit_end_of_reasoning_at_a_call_opener():
    text = 'think [[get {"a": 1}]] after</think> tail'
    result = _factory().parse(text)
    assert result.reasoning == "think"
    assert _calls(result) == [("get", {"a": 1})]
    assert result.content == "after tail"  # the stray </think> is dropped


def test_without_tool_parser_a_call_inside_reasoning_stays_reasoning():
    text = 'think [[get {"a": 1}]]</think>ok'
    result = _factory(tool=None).parse(text)
    assert result.reasoning == 'think [[get {"a": 1}]]' and result.content == "ok"


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([("whole", SAMPLE), ("whole", '[[f {"a": 1}'), ("whole", "a</think>[[g {"),
                        ("whole", COMPLETE), ("incremental", COMPLETE)]),
       st.lists(st.integers(0, 10**4), max_size=10))
def test_any_chunking_adds_up_to_the_one_shot_parse(case, cuts):
    mode, text = case  # incremental mode promises equality only when every call is complete
    factory = _factory(mode=mode)
    want = factory.parse(text)
    pipeline = factory.create()
    _stream(pipeline, text, cuts)
    got = pipeline.result()
    assert (got.reasoning, got.content, got.tool_calls and _calls(got)) == \
        (want.reasoning, want.content, want.tool_calls and _calls(want))


def test_incremental_sends_header_then_fragments_and_whole_sends_once():
    text = '</think>[[get {"city": "Oslo"}]]'
    inc = _stream(_factory().create(), text, cuts=range(len(text)))
    calls = [c for d in inc for c in d.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].name == "get" and calls[0].arguments == ""
    assert all(c.id is None and c.name is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == '{"city": "Oslo"}'
    assert len(calls) > 3  # streamed in pieces
    whole = _stream(_factory(mode="whole").create(), text, cuts=range(len(text)))
    calls = [c for d in whole for c in d.tool_calls]
    assert len(calls) == 1 and calls[0].arguments == '{"city": "Oslo"}'


def test_truncated_call_is_content_in_whole_mode_and_partial_in_incremental():
    text = '</think>Hi [[get {"city": "Os'
    assert _factory(mode="whole").parse(text).content == text[len("</think>"):]
    pipeline = _factory().create()
    _stream(pipeline, text, cuts=[12, 20])
    result = pipeline.result()
    assert result.tool_calls[0]["function"]["name"] == "get"
    assert result.content.startswith("Hi")


def test_thinking_switch_and_defaults():
    assert _factory().parse("a</think>b", enable_thinking=False).content == "a</think>b"
    assert _factory(reasoning="think_off").parse("a</think>b").content == "a</think>b"
    on = _factory(reasoning="think_off").parse("<think>a</think>b", enable_thinking=True)
    assert (on.reasoning, on.content) == ("a", "b")
    assert _factory().parse("cut off").reasoning == "cut off"
    assert _factory().parse("cut off").content is None


def test_swap_when_off_returns_reasoning_as_content_only_without_content():
    factory = _factory(reasoning="swap")
    off = factory.parse("just an answer", enable_thinking=False)
    assert (off.reasoning, off.content) == (None, "just an answer")
    split = factory.parse("why</think>answer", enable_thinking=False)
    assert (split.reasoning, split.content) == ("why", "answer")
    for cuts in ([2], [5, 9], list(range(20))):
        pipeline = factory.create(enable_thinking=False)
        _stream(pipeline, "just an answer", cuts)
        assert pipeline.result().content == "just an answer"


def test_tool_choice_none_turns_tool_parsing_off_and_required_is_checked():
    text = '</think>[[get {}]]'
    assert _factory().parse(text, tool_choice="none").content == "[[get {}]]"
    pipeline = _factory().create(tool_choice="required")
    _stream(pipeline, "</think>no call")
    assert "requires a tool call" in pipeline.tool_choice_error()
    named = {"type": "function", "function": {"name": "other"}}
    assert "called get" in check_tool_choice(named, _factory().parse(text).tool_calls)
    assert check_tool_choice("auto", []) is None
    with pytest.raises(ValueError, match="tool_choice"):
        _factory().create(tool_choice="sometimes")


def test_openai_delta_shapes():
    assert to_openai_delta(ParsedDelta()) is None
    delta = ParsedDelta(reasoning="r", content="c", tool_calls=[
        ToolCallDelta(0, "call_1", "get", ""), ToolCallDelta(0, arguments='{"a"')])
    assert to_openai_delta(delta) == {
        "reasoning_content": "r", "reasoning": "r", "content": "c",
        "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get", "arguments": ""}},
            {"index": 0, "function": {"arguments": '{"a"'}},
        ]}
    message = _factory().parse('r</think>[[get {"a": 1}]]').to_openai_message()
    assert message["reasoning_content"] == message["reasoning"] == "r"
    assert message["content"] is None
    assert message["tool_calls"][0]["type"] == "function"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_run_parse_streams_when_asked():
    text = 'r</think>[[get {"a": "xyz"}]] done'
    expected = {"reasoning": "r", "content": "done",
                "tool_calls": [{"name": "get", "arguments": {"a": "xyz"}}]}
    for kwargs in ({}, {"chunk_size": 1}, {"stream_seed": 7}, {"chunk_size": 3, "mode": "whole"}):
        assert run_parse(text, tool_parser="bracket", reasoning_parser="think",
                         registry=REGISTRY, **kwargs) == expected


def test_thinking_kwargs_and_default_parser_pairs():
    assert thinking_from_kwargs(None) is None
    assert thinking_from_kwargs({"thinking": True}) is True
    assert thinking_from_kwargs({"enable_thinking": False, "thinking": True}) is False
    assert default_parsers("MiniMaxM2ForCausalLM") == ("minimax_m2", "minimax_m2")
    assert default_parsers("Qwen3MoeForCausalLM", "Qwen/Qwen3-Coder-30B-A3B")[0] == "qwen3_coder"
    assert default_parsers("Glm4MoeForCausalLM", "zai-org/GLM-4.7") == ("glm47", "glm45")
    assert default_parsers("UnknownForCausalLM") == (None, None)


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="tool-call-streaming"):
        _factory(mode="lazy")
