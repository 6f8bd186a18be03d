"""Long runs of whitespace (or digits) cost linear work and parse as any other text.

A model stuck repeating newlines after a call, or inside reasoning right after
a call opener, leaves a lookahead (``match_after_ws``, ``followed_by``, ...)
waiting on a long run. Such a run is consumed while waiting and given back
(``Reader.unread``) if the lookahead fails, so the results must not change
for any chunking, and the reader's unconsumed buffer must stay short.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_engine.parsing import Reader, followed_by, match_after_ws, match_any_after_ws
from inference_engine_parsers.testing import TOOLS, exact, factory, parse, result, stream

RUN = "\n" * 150 + " \t" * 60  # longer than what a lookahead keeps in the buffer
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALL = '{"name": "get_time", "arguments": {}}'

# (tool parser, reasoning parser, text): a run where a lookahead waits, then a
# closing marker that matches, something else, or the end of the output.
OUTPUTS = [
    ("qwen3", None, f"<tool_call>{CALL}{RUN}</tool_call>after"),
    ("qwen3", None, f"<tool_call>{CALL}{RUN}x<tool_call>{CALL}"),
    ("qwen3", None, f"<tool_call>{CALL}{RUN}"),
    ("qwen3_coder", None, f"<tool_call>\n<function=get_time>\n</function>{RUN}</tool_call>z"),
    ("qwen3_coder", None, f"<tool_call>\n<function=get_time>\n</function>{RUN}"
                          "<function=get_time>\n</function>"),
    ("qwen3_coder", None, f"<tool_call>\n<function=get_time>\n</function>{RUN}</tool_x"),
    ("nemotron_v2", None, f"<TOOLCALL>[{CALL}]{RUN}</TOOLCALL>"),
    ("nemotron_v2", None, f"<TOOLCALL>[{CALL}]{RUN}</TOOL"),
    ("deepseek_v31", None, f"{B}{CB}get_time{SEP}{{}}{RUN}{CE}{E}"),
    ("deepseek_v31", None, f"{B}{CB}get_time{SEP}{{}}{RUN}{E}"),
    # followed_by in reasoning: the opener is a call, or stays reasoning text
    ("qwen3", "qwen3", f"Plan.<tool_call>{RUN}{CALL}</tool_call></think>done"),
    ("qwen3", "qwen3", f"Plan.<tool_call>{RUN}not json</think>done"),
    ("qwen3", "qwen3", f"Plan.<tool_call>{RUN}"),
    ("qwen3_coder", "qwen3", f"R<tool_call>{RUN}<function=get_time>\n</function></think>ok"),
    # a long number and a string value with long inner and trailing whitespace
    ("qwen3", None, '<tool_call>{"name": "f", "arguments": {"n": 1' + "0" * 300 + "}}"),
    ("minimax_m2", None, '<minimax:tool_call><invoke name="get_weather"><parameter name="city">'
                         f"Os{RUN}lo{RUN}</parameter></invoke></minimax:tool_call>"),
    ("qwen3_coder", None, f"<function=get_weather>\n<parameter=city>\n{RUN}Oslo{RUN}\n"
                          "</parameter>\n</function>"),
    ("glm47", None, f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>{RUN}"
                    "</arg_value></tool_call>"),
]
_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(("tool", "reasoning", "text"), OUTPUTS)
@_settings
@given(cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_long_runs_stream_like_one_shot(tool, reasoning, text, cuts):
    want = exact(factory(tool, reasoning).parse(text, tools=TOOLS))
    for mode in ("whole", "incremental"):
        pipeline, _ = stream(text, tool, reasoning, cuts=cuts, mode=mode)
        assert exact(pipeline.result()) == want


@pytest.mark.parametrize(("tool", "reasoning", "text"), OUTPUTS)
def test_long_runs_one_character_at_a_time(tool, reasoning, text):
    want = exact(factory(tool, reasoning).parse(text, tools=TOOLS))
    pipeline, _ = stream(text, tool, reasoning, cuts=range(len(text)), mode="whole")
    assert exact(pipeline.result()) == want


def test_long_runs_give_the_expected_results():
    assert parse(f"<tool_call>{CALL}{RUN}x", "qwen3") == \
        result(RUN.strip() + "x", [("get_time", {})])
    assert parse(f"Plan.<tool_call>{RUN}not json</think>done", None, "qwen3")["tool_calls"] == []
    assert parse(f"Plan.<tool_call>{RUN}not json</think>done", "qwen3", "qwen3") == \
        result("done", reasoning=f"Plan.<tool_call>{RUN}not json")
    text = ('<minimax:tool_call><invoke name="get_weather"><parameter name="city">'
            f"Os{RUN}lo{RUN}</parameter></invoke></minimax:tool_call>")
    assert parse(text, "minimax_m2")["tool_calls"] == \
        [{"name": "get_weather", "arguments": {"city": f"Os{RUN}lo"}}]


def _feed_one_by_one(grammar, text):
    """Drive ``grammar(r)`` one character per push; the longest unconsumed buffer seen."""
    r = Reader()
    gen = grammar(r)
    longest = 0
    for ch in text:
        r.push(ch)
        try:
            gen.send(None)
        except StopIteration as stop:
            return stop.value, r, longest
        longest = max(longest, len(r.buf) - r.i)
    r.eof = True
    try:
        gen.send(None)
    except StopIteration as stop:
        return stop.value, r, longest
    raise AssertionError("grammar did not finish at end of stream")


@pytest.mark.parametrize("tail", ["</end>", "x", ""])
def test_waiting_lookaheads_keep_the_buffer_short(tail):
    run = "\n" * 5000
    lookaheads = [
        lambda r: match_after_ws(r, "</end>"),
        lambda r: match_any_after_ws(r, ("</end>", "<more>")),
        lambda r: followed_by(r, ("</end>",)),
    ]
    for lookahead in lookaheads:
        def grammar(r, lookahead=lookahead):
            found = yield from lookahead(r)
            return found, r.pos

        (found, pos), r, longest = _feed_one_by_one(grammar, run + tail)
        assert longest < 100  # not the whole run
        assert bool(found) == (tail == "</end>")
        if found and lookahead is not lookaheads[2]:
            assert pos == len(run + tail)  # consumed the run and the marker
        else:
            assert pos == 0  # gave the run back
            assert r.buf[r.i:].startswith(run)


def test_unread_restores_text_dropped_by_push():
    r = Reader()
    r.push("ab  ")
    r.i = 4
    r.push("  c")  # drops the consumed "ab  "
    r.i = 2
    r.unread("    ")
    assert r.pos == 2 and r.buf[r.i:] == "    c"
    r.i += 4
    r.unread("  ")  # still in the buffer: only moves back
    assert r.pos == 4 and r.buf[r.i:] == "  c"
