"""Incremental mode: a call that breaks after its header keeps what was sent, and only
the raw text after that goes to content, the same for every chunking (no text twice)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_engine_parsers.testing import exact, stream

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# (tool parser, output, arguments sent before the break, content)
BROKEN = [
    ("qwen3", '<tool_call>{"name": "f", "arguments": {"a": 1, x}}</tool_call>',
     '{"a": 1, ', "x}}</tool_call>"),
    ("qwen3", '<tool_call>{"name": "f", "arguments": {"s": "ab\\q"}}',
     '{"s": "ab', '\\q"}}'),
    ("deepseek_v31", f'{B}{CB}f{SEP}{{"a": "xy" ]{CE}{E}', '{"a": "xy"', f"]{CE}{E}"),
    ("nemotron_v2", '<TOOLCALL>[{"name": "f", "arguments": {"a": tru}}]</TOOLCALL>',
     '{"a": ', "tru}}]</TOOLCALL>"),
]


@pytest.mark.parametrize(("tool", "text", "sent", "content"), BROKEN)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_broken_call_sends_its_start_and_the_rest_is_content(tool, text, sent, content, cuts):
    pipeline, _ = stream(text, tool, cuts=cuts)
    assert exact(pipeline.result()) == (None, content, [("f", sent)])
