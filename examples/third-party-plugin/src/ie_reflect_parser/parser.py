"""A streaming parser for reasoning wrapped in ``<reflect>...</reflect>``.

Text before ``<reflect>`` and after ``</reflect>`` is content. A suffix that
could be the start of a marker is held back until the next delta settles it,
so any chunking of the output gives the same split.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference_engine.interfaces.parsers import ParsedDelta, ReasoningParser

OPEN, CLOSE = "<reflect>", "</reflect>"


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReflectReasoningParser(ReasoningParser):
    def __init__(self, tokenizer=None, enable_thinking: bool | None = None) -> None:
        super().__init__(tokenizer, enable_thinking)
        self._pending = ""
        # "before" the block, "inside" it, or "after" it.
        self._state = "before"

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        out = ParsedDelta()
        buf = self._pending + text
        while buf:
            marker = CLOSE if self._state == "inside" else OPEN
            if self._state == "after":
                out.content += buf
                buf = ""
                break
            pos = buf.find(marker)
            if pos >= 0:
                self._emit(out, buf[:pos])
                buf = buf[pos + len(marker):]
                self._state = "inside" if self._state == "before" else "after"
                continue
            keep = _held_suffix(buf, marker)
            self._emit(out, buf[: len(buf) - keep])
            buf = buf[len(buf) - keep:]
            break
        self._pending = buf
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._emit(out, self._pending)
        self._pending = ""
        return out

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if self._state == "inside":
            out.reasoning += text
        else:
            out.content += text
