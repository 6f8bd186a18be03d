"""nemotron_v2: a JSON array of calls in ``<TOOLCALL>`` (NVIDIA Nemotron Nano v2).

    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>

A bare object is accepted as a one-element array. ``arguments`` may be an
object or a string holding one. The block counts only once the array is
closed, and then as a whole: one bad element makes the whole block content.
"""

from __future__ import annotations

from inference_engine.interfaces.parsers import CallOpener, ToolCallTag
from inference_engine.parsing import (
    Reader,
    Step,
    StreamingToolParser,
    match,
    match_after_ws,
    match_any,
    peek,
    skip_ws,
)

from inference_engine_parsers._json_call import json_call_object

__all__ = ["NemotronV2ToolParser"]


class NemotronV2ToolParser(StreamingToolParser):
    """``<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>``."""

    openers = ("<TOOLCALL>",)
    call_openers = (CallOpener("<TOOLCALL>"),)
    call_tag = ToolCallTag('<TOOLCALL>[{"name": "{name}", "arguments": ', "}]</TOOLCALL>",
                           "<TOOLCALL>")

    def parse_block(self, r: Reader, opener: str) -> Step:
        yield from skip_ws(r)
        first = yield from peek(r)
        if first == "{":
            if not (yield from json_call_object(self, r, allow_string_arguments=True)):
                return None
        elif first == "[":
            r.i += 1
            yield from skip_ws(r)
            if not (yield from match(r, "]")):
                while True:
                    yield from skip_ws(r)
                    if (yield from peek(r)) != "{":
                        return None
                    if not (yield from json_call_object(self, r, allow_string_arguments=True)):
                        return None
                    yield from skip_ws(r)
                    separator = yield from match_any(r, (",", "]"))
                    if separator is None:
                        return None
                    if separator == "]":
                        break
        else:
            return None
        self.commit()
        if (yield from match_after_ws(r, "</TOOLCALL>")):
            self.commit()
        return None
