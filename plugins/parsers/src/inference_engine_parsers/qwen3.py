"""qwen3: hermes-style JSON calls in ``<tool_call>`` blocks (Qwen3, Qwen2.5).

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    </tool_call>

The block ends where the JSON object ends (a ``<tool_call>`` inside a JSON
string is data); the closing tag is optional. A body that does not start with
``{`` is not a call. Arguments pass through without schema coercion; given
as a JSON string that holds an object, they are decoded to that object, as
vLLM's hermes parser does.
"""

from __future__ import annotations

from inference_engine.interfaces.parsers import CallOpener, ToolCallTag
from inference_engine.parsing import (
    Reader,
    Step,
    StreamingToolParser,
    match_after_ws,
    peek,
    skip_ws,
)

from inference_engine_parsers._json_call import json_call_object

__all__ = ["Qwen3ToolParser"]


class Qwen3ToolParser(StreamingToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one call per block."""

    openers = ("<tool_call>",)
    call_openers = (CallOpener("<tool_call>", "{"),)
    call_tag = ToolCallTag('<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>",
                           "<tool_call>")

    def parse_block(self, r: Reader, opener: str) -> Step:
        yield from skip_ws(r)
        if (yield from peek(r)) != "{":
            return None
        if not (yield from json_call_object(self, r, allow_string_arguments=True)):
            return None
        self.commit()
        if (yield from match_after_ws(r, "</tool_call>")):
            self.commit()
        return None
