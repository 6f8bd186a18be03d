"""The ``reflect_calls`` tool parser: found by name, and it keeps the core's guarantees.

No text is lost (malformed, truncated and unknown-tool blocks come back as
content), markers split across deltas are held, both delivery modes work,
and any chunking gives the non-streaming result.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_engine.parsing import (
    ParserPipeline,
    PipelineFactory,
    ThinkReasoningParser,
    to_openai_delta,
)
from inference_engine.plugins import load_plugins
from ie_reflect_parser.tool_parser import ReflectCallsToolParser

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
WEATHER = '<call name="get_weather">{"city": "Paris"}</call>'


def _factory(mode: str = "incremental", reasoning: str | None = None) -> PipelineFactory:
    return PipelineFactory(tool_parser="reflect_calls", reasoning_parser=reasoning, mode=mode)


def _exact(parsed) -> tuple:
    """(reasoning, content, [(name, arguments text)]): ids left out."""
    return (parsed.reasoning, parsed.content,
            [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls])


def _parse(text: str, tools=TOOLS, reasoning: str | None = None) -> tuple:
    return _exact(_factory(reasoning=reasoning).parse(text, tools=tools))


def _stream(text: str, cuts=(), mode: str = "incremental", tools=TOOLS,
            reasoning: str | None = None):
    """(pipeline, deltas) after feeding ``text`` split at ``cuts``."""
    pipeline = _factory(mode, reasoning).create(tools=tools)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    deltas = [pipeline.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    deltas.append(pipeline.finish())
    return pipeline, deltas


# ------------------------------------------------------------------ discovery


def test_registered_through_the_plugin_hook_and_resolvable_by_name():
    plugin_set = load_plugins()
    info = {i.name: i for i in plugin_set.infos}["reflect"]
    assert info.status == "ok"
    assert info.provides["tool_parsers"] == ["reflect_calls"]
    assert plugin_set.registry.resolve("tool_parsers", "reflect_calls") is ReflectCallsToolParser
    factory = PipelineFactory(tool_parser="reflect_calls")
    assert factory.tool_parser_cls is ReflectCallsToolParser
    parsed = factory.parse(f"Sure. {WEATHER}", tools=TOOLS)
    assert parsed.finish_reason == "tool_calls"
    assert parsed.tool_calls[0]["id"].startswith("call_")
    assert parsed.simple() == {"reasoning": None, "content": "Sure.", "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]}


# ------------------------------------------------------------------ the format


def test_single_call_gives_canonical_json_arguments():
    text = '<call name="get_weather">\n  {"city":"Paris",\n "days":2}\n</call>'
    assert _parse(text) == (None, None, [("get_weather", '{"city": "Paris", "days": 2}')])
    # single quotes and whitespace inside the tag are accepted too
    assert _parse("<call\n  name='get_time' >{}</call>") == (None, None, [("get_time", "{}")])


def test_multiple_calls_and_the_content_around_them():
    text = f'Sure.\n{WEATHER}\nand then <call name="get_time">{{}}</call>\nDone.'
    assert _parse(text) == (None, "Sure.\n\nand then \nDone.",
                            [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])


def test_markers_inside_json_strings_are_data():
    text = '<call name="get_weather">{"city": "<call name=\\"x\\">{}</call>"}</call>'
    args = '{"city": "<call name=\\"x\\">{}</call>"}'
    assert _parse(text) == (None, None, [("get_weather", args)])


# Blocks rejected before the call's header could be sent: content in both modes.
REJECTED_EARLY = [
    '<call name="get_weather">["Paris"]</call>',           # arguments not an object
    '<call name="get_weather">"Paris"</call>',
    '<call name="">{}</call>',                            # empty name
    '<call name="get weather">{}</call>',                 # whitespace in the name
    '<call name=get_weather>{}</call>',                   # unquoted name
    '<call name="get_weather\'>{}</call>',                # mismatched quotes
    '<call nam="get_weather">{}</call>',
    '<call name="get_weather" id="1">{}</call>',           # unknown attribute
    '<callname="get_weather">{}</call>',                  # "<call" needs whitespace after it
    '<caller name="get_weather">{}</call>',
    '<call name="send_email">{}</call>',                  # a tool the request does not list
]
# Blocks that break after the header: content in whole mode (and non-streaming).
REJECTED_LATE = [
    '<call name="get_weather">{"city": Paris}</call>',     # not JSON
    '<call name="get_weather">{"city": "Paris"} trailing</call>',
    '<call name="get_weather">{"city": "Paris"}</cal>',
]


@pytest.mark.parametrize("block", REJECTED_EARLY + REJECTED_LATE)
@pytest.mark.parametrize("mode", ["whole", "incremental"])
def test_malformed_block_stays_content_as_written_and_others_still_count(block, mode):
    text = f"A {block} B {WEATHER} C"
    want = (None, f"A {block} B  C", [("get_weather", '{"city": "Paris"}')])
    assert _parse(text) == want
    if mode == "whole" or block in REJECTED_EARLY:
        for cuts in ([], range(len(text)), [len(text) // 3, len(text) // 2]):
            pipeline, _ = _stream(text, cuts=cuts, mode=mode)
            assert _exact(pipeline.result()) == want


def test_malformed_after_the_header_in_incremental_mode_keeps_the_rest_as_content():
    text = f'<call name="get_weather">{{"city": "Paris"}} oops</call> {WEATHER}'
    for cuts in ([], range(len(text))):
        pipeline, _ = _stream(text, cuts=cuts)
        # the header and arguments were sent before "oops"; no text is sent twice
        assert _exact(pipeline.result()) == (
            None, "oops</call>",
            [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("text", [
    '<call name="get_weather">{"city": "Paris"}',          # no </call>
    '<call name="get_weather">{"city": "Par',
    '<call name="get_wea',
    "<call ",
    "<ca",
])
def test_truncated_call_is_content(text):
    want = (None, f"Hi {text}".strip(), [])
    assert _parse(f"Hi {text}") == want
    pipeline, _ = _stream(f"Hi {text}", cuts=range(len(text) + 3), mode="whole")
    assert _exact(pipeline.result()) == want


def test_truncated_call_in_incremental_mode_ends_as_sent_and_loses_no_text():
    text = 'Hi <call name="get_weather">{"city": "Par'
    pipeline, _ = _stream(text, cuts=range(len(text)))
    assert _exact(pipeline.result()) == (None, "Hi", [("get_weather", '{"city": "Par')])


def test_unknown_tool_is_content_but_names_are_not_checked_without_tools():
    block = '<call name="send_email">{"to": "<call name=\\"get_time\\">{}</call>"}</call>'
    text = f"A {block} {WEATHER}"
    for mode in ("whole", "incremental"):
        pipeline, _ = _stream(text, cuts=range(len(text)), mode=mode)
        assert _exact(pipeline.result()) == \
            (None, f"A {block}", [("get_weather", '{"city": "Paris"}')])
    assert _parse(block, tools=None) == \
        (None, None, [("send_email", '{"to": "<call name=\\"get_time\\">{}</call>"}')])


# ------------------------------------------------------------------ streaming


@pytest.mark.parametrize("mode", ["whole", "incremental"])
def test_markers_split_across_deltas_are_held_not_leaked(mode):
    text = f'Sure {WEATHER} and <caller> x<call\n name="get_time">{{}}</call>!'
    for cut in range(1, len(text)):
        pipeline, deltas = _stream(text, cuts=[cut], mode=mode)
        for delta in deltas:
            # content deltas may hold "<caller>" but never a piece of a call
            assert "<call " not in delta.content and not delta.content.endswith("<")
            assert not delta.content.endswith("<cal")
        assert _exact(pipeline.result()) == (
            None, "Sure  and <caller> x!",
            [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])


def test_incremental_mode_sends_the_header_first_then_argument_fragments():
    text = f"Sure. {WEATHER}"
    _, deltas = _stream(text, cuts=range(len(text)))
    calls = [c for d in deltas for c in d.tool_calls]
    assert (calls[0].index, calls[0].name, calls[0].arguments) == (0, "get_weather", "")
    assert calls[0].id.startswith("call_")
    fragments = [c.arguments for c in calls[1:]]
    assert all(c.id is None and c.name is None for c in calls[1:])
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris"}'
    first = [to_openai_delta(d) for d in deltas if d.tool_calls][0]
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


def test_whole_mode_sends_each_call_in_one_delta_once_closed():
    text = f"Sure. {WEATHER}"
    for cut in range(len(text)):
        _, deltas = _stream(text, cuts=[cut], mode="whole")
        calls = [(i, c) for i, d in enumerate(deltas) for c in d.tool_calls]
        assert len(calls) == 1
        index, call = calls[0]
        assert call.arguments == '{"city": "Paris"}'
        assert index == 1  # the delta that brought the last ">" of </call>


def test_pairs_with_the_reflect_reasoning_parser():
    text = f"<reflect>Needs the weather.</reflect>Checking. {WEATHER}"
    want = ("Needs the weather.", "Checking.", [("get_weather", '{"city": "Paris"}')])
    assert _parse(text, reasoning="reflect") == want
    pipeline, _ = _stream(text, cuts=range(len(text)), reasoning="reflect")
    assert _exact(pipeline.result()) == want


def test_call_openers_end_think_reasoning_at_a_call():
    text = f"Let me check.\n{WEATHER}\n</think>Done."
    for cut in range(len(text) + 1):
        pipeline = ParserPipeline(ThinkReasoningParser(), ReflectCallsToolParser(tools=TOOLS))
        pipeline.feed(text[:cut])
        pipeline.feed(text[cut:])
        pipeline.finish()
        assert _exact(pipeline.result()) == \
            ("Let me check.", "Done.", [("get_weather", '{"city": "Paris"}')])


# ------------------------------------------------------------------ properties

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=12,
)
_arguments = st.dictionaries(st.text(max_size=8), _json, max_size=5)
_cuts = st.lists(st.integers(0, 10**6), max_size=16)
_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(calls=st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]), _arguments,
                                st.text(max_size=12)), max_size=4),
       cuts=_cuts, mode=st.sampled_from(["whole", "incremental"]))
def test_any_chunking_of_complete_calls_gives_the_non_streaming_result(calls, cuts, mode):
    text = "".join(f'{gap}<call name="{name}">{json.dumps(args, ensure_ascii=False)}</call>'
                   for name, args, gap in calls)
    want = _parse(text)
    assert [(n, json.loads(a)) for n, a in want[2]] == [(n, args) for n, args, _ in calls]
    pipeline, _ = _stream(text, cuts=cuts, mode=mode)
    assert _exact(pipeline.result()) == want


_PIECES = ["<call", " ", "\n", "name=", '"get_weather"', "'get_time'", '"nope"', ">", "<",
           "{}", '{"city": "Paris"}', '{"city": ', '"', "}", "</call>", "</cal", "x", "ø", "{"]


@_settings
@given(pieces=st.lists(st.sampled_from(_PIECES), max_size=40), cuts=_cuts)
def test_any_chunking_of_any_output_in_whole_mode_gives_the_non_streaming_result(pieces, cuts):
    text = "".join(pieces)
    want = _parse(text)
    pipeline, _ = _stream(text, cuts=cuts, mode="whole")
    assert _exact(pipeline.result()) == want
    # incremental mode: every complete call is there; only a call whose header was
    # sent before it broke may be extra, and without one the results agree
    pipeline, _ = _stream(text, cuts=cuts)
    got = _exact(pipeline.result())
    remaining = iter(got[2])
    assert all(call in remaining for call in want[2])
    if got[2] == want[2]:
        assert got == want
