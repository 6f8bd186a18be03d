"""minimax_m2: ``<minimax:tool_call>`` wrappers of ``<invoke>`` calls (MiniMax-M2/M2.1/M2.5).

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Oslo</parameter>
    </invoke>
    </minimax:tool_call>

Names may be double-quoted, single-quoted or bare; other attributes on
``<invoke>`` and ``<parameter>`` are ignored. Each invoke is one call
and counts once ``</invoke>`` is seen, so an unclosed wrapper whose invokes are
complete still yields them. Values are typed as ``_values.minimax_value`` says.
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

from inference_engine_parsers._values import minimax_value

__all__ = ["MiniMaxM2ToolParser"]

_QUOTED_STOP = {'"': re.compile(r'["<>\n]'), "'": re.compile(r"['<>\n]")}
_BARE_STOP = re.compile(r"""[\s<>"']""")
_KEY_STOP = re.compile(r"""[\s=<>"'/]""")
_VALUE_END = MarkerSet(["</parameter>"])


def _attribute_value(r: Reader) -> Step:
    """A double-quoted, single-quoted or bare value; None if a quote is left open."""
    quote = yield from peek(r)
    if quote in _QUOTED_STOP:
        r.i += 1
        value = yield from read_until_char(r, _QUOTED_STOP[quote])
        if (yield from peek(r)) != quote:
            return None
        r.i += 1
        return value.strip()
    return (yield from read_until_char(r, _BARE_STOP))


def _name_attribute(r: Reader) -> Step:
    """The attributes after ``<invoke``/``<parameter`` up to ``>``: the ``name``, or None.

    Other attributes (``description="…"``, ``type="string"``) are read and
    ignored, so they never turn a call into content (vLLM issue #32827).
    """
    name: str | None = None
    while True:
        c = yield from peek(r)
        if c == ">" and name is not None:
            r.i += 1
            return name
        if c is None or not c.isspace():
            return None
        yield from skip_ws(r)
        if (yield from peek(r)) == ">":
            continue
        key = yield from read_until_char(r, _KEY_STOP)
        if not key:
            return None
        yield from skip_ws(r)
        if not (yield from match(r, "=")):
            return None  # an attribute without a value
        yield from skip_ws(r)
        value = yield from _attribute_value(r)
        if value is None:
            return None
        if key == "name" and name is None:
            if not value:
                return None
            name = value


class MiniMaxM2ToolParser(StreamingToolParser):
    """``<minimax:tool_call><invoke name=F><parameter name=P>V</parameter></invoke>…``."""

    openers = ("<minimax:tool_call>",)
    call_openers = (CallOpener("<minimax:tool_call>"),)
    call_tag = ToolCallTag('<minimax:tool_call>\n<invoke name="{name}">\n',
                           "\n</invoke>\n</minimax:tool_call>", "<minimax:tool_call>",
                           style="minimax_xml", name_in_json_string=False)

    def parse_block(self, r: Reader, opener: str) -> Step:
        while True:
            yield from skip_ws(r)
            tag = yield from match_any(r, ("<invoke", "</minimax:tool_call>"))
            if tag is None:
                return None
            if tag == "</minimax:tool_call>":
                self.commit()
                return None
            name = yield from _name_attribute(r)
            if name is None:
                return None
            if not (yield from self._invoke_body(r, name)):
                return None
            self.commit()

    def _invoke_body(self, r: Reader, name: str) -> Step:
        """Parameters up to ``</invoke>``; True when it closed."""
        self.begin_call(name)
        self.call_args("{")
        separator = ""
        while True:
            yield from skip_ws(r)
            tag = yield from match_any(r, ("<parameter", "</invoke>"))
            if tag is None:
                return False
            if tag == "</invoke>":
                self.call_args("}")
                return True
            param = yield from _name_attribute(r)
            if param is None:
                return False
            self.call_args(separator + json.dumps(param, ensure_ascii=False) + ": ")
            separator = ", "
            value = minimax_value(self.call_args, self.param_schema(name, param))
            if (yield from until(r, _VALUE_END, value.feed)) is None:
                return False
            value.finish()
