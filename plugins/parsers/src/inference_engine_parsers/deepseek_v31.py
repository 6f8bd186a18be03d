"""deepseek_v31: DeepSeek-V3.1 calls between fullwidth-bar special tokens.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line in the output; wrapped here)

Bars are U+FF5C, separators U+2581. Each call counts once its JSON object is
closed; arguments pass through without schema coercion (raw newlines inside
the JSON are fine here, unlike vLLM's regex).
"""

from __future__ import annotations

import re

from inference_engine.interfaces.parsers import CallOpener, ToolCallTag
from inference_engine.parsing import (
    Reader,
    Step,
    StreamingToolParser,
    json_value,
    match,
    match_after_ws,
    match_any,
    peek,
    read_until_char,
    skip_ws,
)

__all__ = ["DeepSeekV31ToolParser"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_NAME_STOP = re.compile(r"""[\s<>"'{}]""")


class DeepSeekV31ToolParser(StreamingToolParser):
    """``<｜tool▁calls▁begin｜>`` … ``<｜tool▁calls▁end｜>`` with one or more calls."""

    openers = (CALLS_BEGIN,)
    call_openers = (CallOpener(CALLS_BEGIN),)
    call_tag = ToolCallTag(CALLS_BEGIN + CALL_BEGIN + "{name}" + SEP, CALL_END + CALLS_END,
                           CALLS_BEGIN, name_in_json_string=False)

    def parse_block(self, r: Reader, opener: str) -> Step:
        while True:
            yield from skip_ws(r)
            tag = yield from match_any(r, (CALL_BEGIN, CALLS_END))
            if tag is None:
                return None
            if tag == CALLS_END:
                self.commit()
                return None
            name = yield from read_until_char(r, _NAME_STOP)
            if not name or not (yield from match(r, SEP)):
                return None
            self.begin_call(name)
            yield from skip_ws(r)
            if (yield from peek(r)) != "{":
                return None
            if not (yield from json_value(r, self.call_args)):
                return None
            self.commit()
            if (yield from match_after_ws(r, CALL_END)):
                self.commit()
