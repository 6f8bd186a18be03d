"""glm45 / glm47: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>``.

GLM-4.5/4.6 put a newline after the name and after each tag; GLM-4.7/5 put no
whitespace and write zero-argument calls as ``<tool_call>get_time</tool_call>``.
One grammar covers both: the name ends at whitespace or ``<``, whitespace
between tags is ignored, keys are stripped. A block counts only once
``</tool_call>`` is seen. Values are typed as ``_values.glm_value`` says.
"""

from __future__ import annotations

import json
import re

from inference_engine.interfaces.parsers import CallOpener, ToolCallTag
from inference_engine.parsing import (
    MarkerSet,
    Reader,
    Step,
    StreamingToolParser,
    match,
    match_any,
    peek,
    read_until_char,
    skip_ws,
    until,
)

from inference_engine_parsers._values import glm_value

__all__ = ["Glm45ToolParser", "Glm47ToolParser"]

_NAME_STOP = re.compile(r"""[\s<>"'{}]""")
_KEY_END = MarkerSet(["</arg_key>", "<arg_key>", "<arg_value>", "</arg_value>", "</tool_call>"])
_VALUE_END = MarkerSet(["</arg_value>"])


class Glm45ToolParser(StreamingToolParser):
    """GLM-4.5/4.6 calls (also reads the GLM-4.7 layout)."""

    openers = ("<tool_call>",)
    call_openers = (CallOpener("<tool_call>"),)
    # Forced calls are written in the 4.7 layout (no whitespace between the tags), which
    # both parsers read: the parser keeps a value's newlines, so none may surround it.
    call_tag = ToolCallTag("<tool_call>{name}", "</tool_call>", "<tool_call>",
                           style="glm_xml", name_in_json_string=False, whitespace="")

    def parse_block(self, r: Reader, opener: str) -> Step:
        yield from skip_ws(r)
        name = yield from read_until_char(r, _NAME_STOP)
        after = yield from peek(r)
        if not name or after is None or not (after == "<" or after.isspace()):
            return None
        self.begin_call(name)
        self.call_args("{")
        separator = ""
        while True:
            yield from skip_ws(r)
            tag = yield from match_any(r, ("<arg_key>", "</tool_call>"))
            if tag is None:
                return None
            if tag == "</tool_call>":
                self.call_args("}")
                self.commit()
                return None
            key_parts: list[str] = []
            end = yield from until(r, _KEY_END, key_parts.append, consume=False)
            key = "".join(key_parts).strip()
            if end != "</arg_key>" or not key:
                return None
            r.i += len(end)
            yield from skip_ws(r)
            if not (yield from match(r, "<arg_value>")):
                return None
            self.call_args(separator + json.dumps(key, ensure_ascii=False) + ": ")
            separator = ", "
            value = glm_value(self.call_args, self.param_schema(name, key))
            if (yield from until(r, _VALUE_END, value.feed)) is None:
                return None
            value.finish()


class Glm47ToolParser(Glm45ToolParser):
    """GLM-4.7 and GLM-5/5.1 (no whitespace between tags); same grammar."""
