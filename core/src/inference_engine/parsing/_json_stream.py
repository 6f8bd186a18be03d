"""Incremental JSON: check one value and write its canonical text as it becomes certain.

The canonical text is what ``json.dumps(json.loads(raw), ensure_ascii=False)``
writes (``", "`` and ``": "`` separators, ``\\n``-style escapes, non-ASCII as
is), so streamed argument fragments join into the same string a one-shot
parse gives. Strings stream character by character; numbers and literals are
written once complete.

Deliberate leniencies and limits:

- raw control characters inside strings are accepted (``json.loads(strict=False)``)
  and written escaped; models often put raw newlines in code arguments;
- ``NaN``/``Infinity`` are rejected (they are not JSON);
- a lone surrogate escape is written as a ``\\uXXXX`` escape, keeping the
  output encodable;
- duplicate keys are written as they come (``json.loads`` would keep the last).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

from inference_engine.parsing._reader import Reader, Step

__all__ = ["JsonStreamer", "json_value", "json_string"]

_encode = json.encoder.encode_basestring  # type: ignore[attr-defined]

_WS = re.compile(r"[ \t\n\r]*")
_STR_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUM_CHARS = re.compile(r"[0-9eE+\-.]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}\Z")
# Prefixes of a low-surrogate escape "\\uDC00".."\\uDFFF".
_LOW_PREFIX = re.compile(r"(?:\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]{0,2})?)?)?)?\Z")
_SIMPLE_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "/", "b": "\\b", "f": "\\f",
                   "n": "\\n", "r": "\\r", "t": "\\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}

# Parser states.
_VALUE, _ARR_FIRST, _KEY_FIRST, _KEY, _COLON, _OBJ_NEXT, _ARR_NEXT, _STRING = range(8)


def _escape_char(code: int) -> str:
    if 0xD800 <= code < 0xE000:  # lone surrogate
        return f"\\u{code:04x}"
    return _encode(chr(code))[1:-1]


def _canonical_number(token: str) -> str:
    try:
        if "." in token or "e" in token or "E" in token:
            value = float(token)
            return repr(value) if math.isfinite(value) else token
        return str(int(token))
    except ValueError:  # more digits than int() accepts
        return token


class JsonStreamer:
    """Checks one JSON value fed in pieces and writes its canonical text to ``out``.

    Call :meth:`feed` with the buffer and a start index; it returns the index
    where it stopped: just past the value once :attr:`done`, at the offending
    character once :attr:`failed`, or where it needs more input to decide.
    Characters it has not consumed must be offered again on the next call.
    """

    def __init__(self, out: Callable[[str], None]) -> None:
        self._out = out
        self._stack: list[bool] = []  # True for an object, False for an array
        self._state = _VALUE
        self._in_key = False
        # Characters of a number at the feed position already scanned while
        # waiting for its end (so a long number is not re-scanned per delta).
        self._num_scanned = 0
        # The first non-space character of the value once seen ("{", "[", '"', ...).
        self.first_char: str | None = None
        self.done = False
        self.failed = False

    def feed(self, buf: str, i: int, eof: bool = False) -> int:
        """Consume from ``buf[i:]``; ``eof`` says no more text will come."""
        n = len(buf)
        out = self._out
        while not (self.done or self.failed):
            state = self._state
            if state == _STRING:
                run = _STR_RUN.match(buf, i)
                if run is not None:
                    out(run.group())
                    i = run.end()
                if i >= n:
                    break
                c = buf[i]
                if c == '"':
                    out('"')
                    i += 1
                    if self._in_key:
                        self._state = _COLON
                    else:
                        self._value_done()
                elif c == "\\":
                    used = self._escape(buf, i, eof)
                    if used == 0:
                        break
                    i += used
                else:  # raw control character: accepted, written escaped
                    out(_escape_char(ord(c)))
                    i += 1
                continue
            i = _WS.match(buf, i).end()
            if i >= n:
                break
            c = buf[i]
            if self.first_char is None:
                self.first_char = c
            if state == _VALUE or state == _ARR_FIRST:
                if state == _ARR_FIRST and c == "]":
                    out("]")
                    i += 1
                    self._stack.pop()
                    self._value_done()
                elif c == "{":
                    out("{")
                    i += 1
                    self._stack.append(True)
                    self._state = _KEY_FIRST
                elif c == "[":
                    out("[")
                    i += 1
                    self._stack.append(False)
                    self._state = _ARR_FIRST
                elif c == '"':
                    out('"')
                    i += 1
                    self._in_key = False
                    self._state = _STRING
                elif c == "-" or "0" <= c <= "9":
                    end = _NUM_CHARS.match(buf, i + self._num_scanned).end()
                    if end >= n and not (eof and not self._stack):
                        self._num_scanned = end - i
                        break  # the number may go on (or, at eof inside a container, fail below)
                    self._num_scanned = 0
                    token = buf[i:end]
                    if not _NUMBER.match(token):
                        self.failed = True
                        break
                    out(_canonical_number(token))
                    i = end
                    self._value_done()
                elif c in _LITERALS:
                    literal = _LITERALS[c]
                    avail = buf[i: i + len(literal)]
                    if avail == literal:
                        out(literal)
                        i += len(literal)
                        self._value_done()
                    elif len(avail) < len(literal) and literal.startswith(avail):
                        break
                    else:
                        self.failed = True
                else:
                    self.failed = True
            elif state == _KEY_FIRST and c == "}":
                out("}")
                i += 1
                self._stack.pop()
                self._value_done()
            elif state == _KEY_FIRST or state == _KEY:
                if c == '"':
                    out('"')
                    i += 1
                    self._in_key = True
                    self._state = _STRING
                else:
                    self.failed = True
            elif state == _COLON:
                if c == ":":
                    out(": ")
                    i += 1
                    self._state = _VALUE
                else:
                    self.failed = True
            else:  # _OBJ_NEXT / _ARR_NEXT
                close = "}" if state == _OBJ_NEXT else "]"
                if c == ",":
                    out(", ")
                    i += 1
                    self._state = _KEY if state == _OBJ_NEXT else _VALUE
                elif c == close:
                    out(close)
                    i += 1
                    self._stack.pop()
                    self._value_done()
                else:
                    self.failed = True
        if eof and not self.done:
            self.failed = True
        return i

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
        else:
            self._state = _OBJ_NEXT if self._stack[-1] else _ARR_NEXT

    def _escape(self, buf: str, i: int, eof: bool) -> int:
        """Write the escape at ``buf[i]`` (a backslash); return chars used, 0 to wait."""
        n = len(buf)
        if i + 1 >= n:
            return self._wait(eof)
        kind = buf[i + 1]
        if kind in _SIMPLE_ESCAPES:
            self._out(_SIMPLE_ESCAPES[kind])
            return 2
        if kind != "u":
            self.failed = True
            return 0
        if i + 6 > n:
            return self._wait(eof)
        digits = buf[i + 2: i + 6]
        if not _HEX4.match(digits):
            self.failed = True
            return 0
        code = int(digits, 16)
        if 0xD800 <= code < 0xDC00:  # high surrogate: a low one may follow
            tail = buf[i + 6: i + 12]
            if len(tail) == 6 and tail[:2] == "\\u" and _HEX4.match(tail[2:]):
                low = int(tail[2:], 16)
                if 0xDC00 <= low < 0xE000:
                    self._out(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    return 12
            elif len(tail) < 6 and _LOW_PREFIX.match(tail) and not eof:
                return 0
        self._out(_escape_char(code))
        return 6

    def _wait(self, eof: bool) -> int:
        if eof:
            self.failed = True
        return 0


def json_value(r: Reader, out: Callable[[str], None]) -> Step:
    """Read one JSON value at ``r``, writing canonical text to ``out``.

    Returns True once the value is complete (consumed), False when it is not
    valid JSON (``r`` then points at the offending character) or the stream
    ended inside it.
    """
    pending: list[str] = []
    streamer = JsonStreamer(pending.append)
    while True:
        r.i = streamer.feed(r.buf, r.i, r.eof)
        if pending:
            # NOTE: written only once r.i is past the text they stand for, so a
            # sink that notes r.pos (StreamingToolParser.call_args) knows where
            # the sent text ends; the rest of a broken call goes to content.
            out("".join(pending))
            pending.clear()
        if streamer.done:
            return True
        if streamer.failed or r.eof:
            return False
        yield


def json_string(r: Reader) -> Step:
    """Read one JSON string value and return it decoded; None if not a string or invalid."""
    parts: list[str] = []
    while r.i >= len(r.buf):
        if r.eof:
            return None
        yield
    if r.buf[r.i] != '"':
        return None
    ok = yield from json_value(r, parts.append)
    return json.loads("".join(parts), strict=False) if ok else None
