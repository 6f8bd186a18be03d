"""qwen3_coder / nemotron_v3: XML functions and parameters (Qwen3-Coder, Qwen3.5, Nemotron 3).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

- The function name runs to the first ``>``; an empty name, or one with
  whitespace, quotes, ``{}`` or ``<>``, makes the block content.
- A value ends at ``</parameter>``, or (closing tag missing) at the next
  ``<parameter=`` or ``</function>``; inside it ``<``, ``&&`` and blank lines
  are data. One leading and one trailing newline are removed.
- ``<function=…>…</function>`` without the wrapper is a call too (a stray
  ``</tool_call>`` right after it is dropped, as vLLM does); a wrapper may
  hold several functions.
- A call counts once ``</function>`` is seen. Values are typed from the
  tool's schema (``_values.coder_value``).
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
    match_after_ws,
    match_any,
    match_any_after_ws,
    peek,
    read_until_char,
    skip_ws,
    until,
)

from inference_engine_parsers._values import coder_value

__all__ = ["NemotronV3ToolParser", "Qwen3CoderToolParser"]

_NAME_STOP = re.compile(r"""[>\s"'{}<]""")
_PARAM_NAME_STOP = re.compile(r"[<>]")
_VALUE_END = MarkerSet(["</parameter>", "<parameter=", "</function>"])


class Qwen3CoderToolParser(StreamingToolParser):
    """``<tool_call><function=NAME><parameter=K>V</parameter>…</function></tool_call>``."""

    openers = ("<tool_call>", "<function=")
    call_openers = (CallOpener("<tool_call>", "<function="),)
    call_tag = ToolCallTag("<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>",
                           "<tool_call>", style="qwen_xml", name_in_json_string=False,
                           whitespace="\n")

    def parse_block(self, r: Reader, opener: str) -> Step:
        is_wrapped = opener == "<tool_call>"
        if is_wrapped:
            yield from skip_ws(r)
            if not (yield from match(r, "<function=")):
                return None
        while True:
            if not (yield from self._function(r)):
                return None
            self.commit()
            if not is_wrapped:
                # A model that left out the opening <tool_call> may still close
                # it; that stray closing tag is markup of the call, not content.
                if (yield from match_after_ws(r, "</tool_call>")):
                    self.commit()
                return None
            tag = yield from match_any_after_ws(r, ("</tool_call>", "<function="))
            if tag != "<function=":
                if tag is not None:
                    self.commit()
                return None

    def _function(self, r: Reader) -> Step:
        """The rest of one function after ``<function=``; True when ``</function>`` closed it."""
        name = yield from read_until_char(r, _NAME_STOP)
        if not name or (yield from peek(r)) != ">":
            return False
        r.i += 1
        self.begin_call(name)
        self.call_args("{")
        separator = ""
        while True:
            yield from skip_ws(r)
            tag = yield from match_any(r, ("<parameter=", "</function>"))
            if tag is None:
                return False
            if tag == "</function>":
                self.call_args("}")
                return True
            param = yield from read_until_char(r, _PARAM_NAME_STOP)
            param = param.strip()
            if not param or (yield from peek(r)) != ">":
                return False
            r.i += 1
            self.call_args(separator + json.dumps(param, ensure_ascii=False) + ": ")
            separator = ", "
            value = coder_value(self.call_args, self.param_schema(name, param))
            end = yield from until(r, _VALUE_END, value.feed, consume=False)
            if end is None:
                return False
            value.finish()
            if end == "</parameter>":
                r.i += len(end)


class NemotronV3ToolParser(Qwen3CoderToolParser):
    """Nemotron 3 Nano/Super: the qwen3_coder grammar and typing unchanged."""
