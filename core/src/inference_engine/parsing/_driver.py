"""The feed/finish plumbing shared by the grammar-driven parser bases.

A parser pushes each delta into its :class:`Reader`, advances its grammar
(``_step``) and hands out what became certain (``_take``); at the end it marks
the reader at EOF and steps once more. Subclasses supply ``_step`` and ``_take``.
"""

from __future__ import annotations

from inference_engine.parsing._reader import Reader

__all__ = ["ReaderDriven"]


class ReaderDriven:
    """Mixin: ``_feed_text`` / ``_end_stream`` around a subclass's ``_step``."""

    _reader: Reader
    _is_finished: bool

    def _step(self) -> None:
        raise NotImplementedError

    def _feed_text(self, text: str) -> None:
        if self._is_finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self._reader.push(text)
            self._step()

    def _end_stream(self) -> bool:
        """Flush at EOF; False when the stream had already ended."""
        if self._is_finished:
            return False
        self._is_finished = True
        self._reader.eof = True
        self._step()
        return True
