"""An incremental text reader and the scanning primitives grammars are written with.

A parser grammar is a generator over one :class:`Reader`. The primitives below
are generators too (``found = yield from match(r, "</tool_call>")``): each
returns as soon as the text seen so far settles its answer and yields when it
needs more input. The driver pushes a delta, resumes the grammar, and the
grammar yields again when the buffer runs out; at end of stream ``r.eof`` is
set and every primitive decides with what it has.

NOTE: primitives never look behind ``r.i`` and consume only what they decided,
so the unconsumed part of ``r.buf`` stays short (a held partial marker, a
number not yet terminated). That keeps the work linear in the output length:
nothing is re-scanned on later deltas except those few held characters.
The lookaheads that must consume nothing when they fail (``match_after_ws``,
``match_any_after_ws``, ``followed_by``) can meet a long run of whitespace;
they consume a long run while they wait and :meth:`Reader.unread` it if they
fail, so the run is neither re-scanned nor re-copied on every delta.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Generator, Iterable

__all__ = [
    "MarkerSet",
    "Reader",
    "copy_all",
    "followed_by",
    "match",
    "match_any",
    "match_after_ws",
    "match_any_after_ws",
    "peek",
    "read_until_char",
    "skip_ws",
    "until",
]

# The generator type of every primitive: yields None while waiting for input.
Step = Generator[None, None, object]

# JSON whitespace; also what the XML grammars skip between tags.
_WS = re.compile(r"[ \t\n\r]*")
# The longest whitespace run a waiting lookahead keeps in the buffer (see _take_ws).
_MAX_HELD_WS = 64


class MarkerSet:
    """A fixed set of literal markers: earliest match, and held partial suffixes."""

    def __init__(self, markers: Iterable[str]) -> None:
        unique = sorted({m for m in markers if m}, key=len, reverse=True)
        if not unique:
            raise ValueError("MarkerSet needs at least one non-empty marker")
        self.markers = tuple(unique)
        # Longest first, so that at one position the longer marker wins.
        self._regex = re.compile("|".join(re.escape(m) for m in unique))
        self._max_len = len(unique[0])
        self._first_chars = sorted({m[0] for m in unique})
        self._prefixes = {m[:k] for m in unique for k in range(1, len(m))}

    def search(self, buf: str, start: int) -> tuple[int, str] | None:
        """Earliest marker in ``buf[start:]`` as (position, marker), or None."""
        found = self._regex.search(buf, start)
        return (found.start(), found.group()) if found is not None else None

    def held(self, buf: str, start: int) -> int:
        """Length of the longest suffix of ``buf[start:]`` that is a proper prefix of a marker."""
        n = len(buf)
        lo = max(start, n - self._max_len + 1)
        best = n
        for first in self._first_chars:
            k = buf.find(first, lo)
            while k != -1 and k < best:
                if buf[k:] in self._prefixes:
                    best = k
                    break
                k = buf.find(first, k + 1)
        return n - best


class Reader:
    """The unconsumed input of one stream plus a log of raw text for reverts.

    ``buf[i:]`` is what no primitive has consumed yet. Every pushed chunk is
    also kept in a log until :meth:`trim` drops it, so a grammar's owner can
    recover the raw text of a block that turned out not to be a call.
    """

    __slots__ = ("buf", "i", "eof", "_base", "_log", "_log_end")

    def __init__(self) -> None:
        self.buf = ""
        self.i = 0
        self.eof = False
        # Absolute position of buf[0] in the whole stream.
        self._base = 0
        # (absolute start, text) of each pushed chunk still retained.
        self._log: deque[tuple[int, str]] = deque()
        self._log_end = 0

    @property
    def pos(self) -> int:
        """Absolute position of the first unconsumed character."""
        return self._base + self.i

    def push(self, text: str) -> None:
        """Append one delta (drops the consumed prefix of the buffer)."""
        if not text:
            return
        if self.i:
            self.buf = self.buf[self.i:]
            self._base += self.i
            self.i = 0
        self.buf += text
        self._log.append((self._log_end, text))
        self._log_end += len(text)

    def trim(self, keep_from: int) -> None:
        """Forget logged chunks that end at or before absolute ``keep_from``."""
        log = self._log
        while log and log[0][0] + len(log[0][1]) <= keep_from:
            log.popleft()

    def unread(self, text: str) -> None:
        """Give back ``text``, the characters a primitive consumed just before ``i``.

        Used by lookaheads that consume while waiting and must leave the
        reader as they found it when they fail.
        """
        if not text:
            return
        if self.i >= len(text):
            # NOTE: push() drops consumed text only when it appends, so the
            # text is still in buf right before i exactly when i >= len(text).
            self.i -= len(text)
            return
        self.buf = text + self.buf[self.i:]
        self._base += self.i - len(text)
        self.i = 0

    def raw(self, start: int, end: int) -> str:
        """Raw text between two absolute positions (must still be in the log)."""
        if end <= start:
            return ""
        parts = []
        for chunk_start, text in self._log:
            chunk_end = chunk_start + len(text)
            if chunk_end <= start:
                continue
            if chunk_start >= end:
                break
            parts.append(text[max(0, start - chunk_start): end - chunk_start])
        return "".join(parts)


def skip_ws(r: Reader) -> Step:
    """Consume whitespace; return once a non-space character is next (or at eof)."""
    while True:
        r.i = _WS.match(r.buf, r.i).end()
        if r.i < len(r.buf) or r.eof:
            return None
        yield


def _take_ws(r: Reader, taken: list[str]) -> int:
    """Where the whitespace at ``r.i`` ends; a long run is consumed into ``taken``.

    A lookahead leaves a short run in the buffer (re-scanning and re-copying
    it per delta is cheap) and consumes a longer one, keeping it in ``taken``
    to :meth:`Reader.unread` if the lookahead fails.
    """
    j = _WS.match(r.buf, r.i).end()
    if j - r.i > _MAX_HELD_WS:
        taken.append(r.buf[r.i: j])
        r.i = j
    return j


def peek(r: Reader) -> Step:
    """The next character without consuming it; None at end of stream."""
    while r.i >= len(r.buf):
        if r.eof:
            return None
        yield
    return r.buf[r.i]


def match(r: Reader, literal: str) -> Step:
    """Consume ``literal`` if it comes next; True if it did, False (nothing consumed) if not."""
    while True:
        avail = r.buf[r.i: r.i + len(literal)]
        if avail == literal:
            r.i += len(literal)
            return True
        if r.eof or not literal.startswith(avail):
            return False
        yield


def match_any(r: Reader, literals: tuple[str, ...]) -> Step:
    """Consume whichever of ``literals`` comes next and return it; None if none can."""
    longest = max(len(lit) for lit in literals)
    while True:
        buf, i = r.buf, r.i
        for lit in literals:
            if buf.startswith(lit, i):
                r.i = i + len(lit)
                return lit
        avail = buf[i: i + longest]
        if r.eof or not any(len(avail) < len(lit) and lit.startswith(avail) for lit in literals):
            return None
        yield


def match_after_ws(r: Reader, literal: str) -> Step:
    """Consume optional whitespace plus ``literal`` if that comes next, else nothing."""
    taken: list[str] = []
    while True:
        j = _take_ws(r, taken)
        buf = r.buf
        avail = buf[j: j + len(literal)]
        if avail == literal:
            r.i = j + len(literal)
            return True
        if r.eof or (j < len(buf) and not literal.startswith(avail)):
            r.unread("".join(taken))
            return False
        yield


def match_any_after_ws(r: Reader, literals: tuple[str, ...]) -> Step:
    """Consume optional whitespace plus whichever of ``literals`` follows; None (nothing
    consumed) if none does."""
    longest = max(len(lit) for lit in literals)
    taken: list[str] = []
    while True:
        j = _take_ws(r, taken)
        buf = r.buf
        for lit in literals:
            if buf.startswith(lit, j):
                r.i = j + len(lit)
                return lit
        avail = buf[j: j + longest]
        if r.eof or (j < len(buf) and not any(
                len(avail) < len(lit) and lit.startswith(avail) for lit in literals)):
            r.unread("".join(taken))
            return None
        yield


def followed_by(r: Reader, follows: tuple[str, ...]) -> Step:
    """True if optional whitespace then one of ``follows`` comes next; consumes nothing.

    An empty string in ``follows`` always matches.
    """
    if "" in follows:
        return True
    longest = max((len(f) for f in follows), default=1)
    taken: list[str] = []
    while True:
        j = _take_ws(r, taken)
        avail = r.buf[j: j + longest]
        is_match = any(avail.startswith(f) for f in follows)
        if is_match or r.eof or (avail and not any(f.startswith(avail) for f in follows)):
            r.unread("".join(taken))
            return is_match
        yield


def until(r: Reader, markers: MarkerSet, on_text: Callable[[str], None],
          consume: bool = True) -> Step:
    """Pass text to ``on_text`` up to the earliest marker; return that marker.

    Text that could still be the start of a marker is held until the next
    delta settles it. The marker is consumed unless ``consume`` is False. At
    end of stream the held text is passed on and None is returned.
    """
    while True:
        buf, i = r.buf, r.i
        hit = markers.search(buf, i)
        if hit is not None:
            pos, marker = hit
            r.i = pos + len(marker) if consume else pos
            if pos > i:
                on_text(buf[i:pos])
            return marker
        if r.eof:
            r.i = len(buf)
            if len(buf) > i:
                on_text(buf[i:])
            return None
        end = len(buf) - markers.held(buf, i)
        if end > i:
            r.i = end
            on_text(buf[i:end])
        yield


def read_until_char(r: Reader, stop: re.Pattern[str]) -> Step:
    """Consume and return text up to (not including) the first character matching ``stop``.

    ``stop`` is a one-character class such as ``re.compile(r"[>\\s]")``; the
    stopping character stays unconsumed. At end of stream returns what was read.
    """
    parts = []
    while True:
        buf, i = r.buf, r.i
        found = stop.search(buf, i)
        if found is not None:
            parts.append(buf[i: found.start()])
            r.i = found.start()
            return "".join(parts)
        parts.append(buf[i:])
        r.i = len(buf)
        if r.eof:
            return "".join(parts)
        yield


def copy_all(r: Reader, on_text: Callable[[str], None]) -> Step:
    """Pass everything to ``on_text`` until the end of stream."""
    while True:
        if r.i < len(r.buf):
            text, r.i = r.buf[r.i:], len(r.buf)
            on_text(text)
        if r.eof:
            return None
        yield
