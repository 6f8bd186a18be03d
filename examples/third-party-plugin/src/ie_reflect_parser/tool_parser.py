"""``reflect_calls``: tool calls written as ``<call name="NAME">{json arguments}</call>``.

    Let me look that up.<call name="get_weather">{"city": "Paris"}</call>

The class only states the block grammar; the core's
:class:`~inference_engine.parsing.StreamingToolParser` does the rest: passing
content through, holding back a partial ``<call`` at the end of a delta, the
``incremental`` and ``whole`` delivery modes, call ids, and putting a block
that turns out not to be a call back into content as written.

The grammar:

- ``<call``, whitespace, ``name=``, the name in double or single quotes (no
  whitespace, quotes, ``<>`` or ``{}`` in it), optional whitespace, ``>``;
- the arguments, one JSON object (streamed as canonical JSON text);
- optional whitespace, then ``</call>``. Only then does the call count: a
  block cut off before ``</call>`` is content (in ``incremental`` mode the
  fragments already sent stay sent, as the core docs say for every parser).

Unlike the built-in parsers, a call to a tool that the request's ``tools`` do
not list is not returned: its whole block stays content. A request with no
tools at all (``inference-engine parse`` without ``--tools``) checks no names.
"""

from __future__ import annotations

import re

from inference_engine.interfaces.parsers import CallOpener
from inference_engine.parsing import (
    Reader,
    Step,
    StreamingToolParser,
    json_value,
    match,
    match_after_ws,
    peek,
    read_until_char,
    skip_ws,
)

__all__ = ["ReflectCallsToolParser"]

# "<call" and the whitespace that must follow it, so "<caller>" is not an opener.
_OPENERS = ("<call ", "<call\t", "<call\n", "<call\r")
_NAME_STOP = re.compile(r"""[\s"'<>{}]""")


def _discard(_: str) -> None:
    pass


class ReflectCallsToolParser(StreamingToolParser):
    """``<call name="NAME">{json arguments}</call>``, one call per block."""

    openers = _OPENERS
    # Where a call starts, so a reasoning parser with an implicit end (any
    # ThinkReasoningParser) ends reasoning there.
    call_openers = tuple(CallOpener(opener, "name=") for opener in _OPENERS)

    def parse_block(self, r: Reader, opener: str) -> Step:
        yield from skip_ws(r)
        if not (yield from match(r, "name=")):
            return None  # not a call: the base class keeps the text as content
        quote = yield from peek(r)
        if quote not in ('"', "'"):
            return None
        r.i += 1
        name = yield from read_until_char(r, _NAME_STOP)
        if not name or (yield from peek(r)) != quote:
            return None
        r.i += 1
        if not (yield from match_after_ws(r, ">")):
            return None
        yield from skip_ws(r)
        if (yield from peek(r)) != "{":
            return None
        # NOTE: decided from the name alone, so it is the same for every chunking.
        is_known = not self.schemas or name in self.schemas
        if is_known:
            self.begin_call(name)  # incremental mode sends the header now
        # An unknown tool's block is still read to its end, so that all of it
        # (a "<call" inside its JSON strings included) comes back as content.
        if not (yield from json_value(r, self.call_args if is_known else _discard)):
            return None
        if not (yield from match_after_ws(r, "</call>")):
            return None
        if is_known:
            self.commit()  # the block can no longer turn back into content
        return None
