"""A base class for streaming tool parsers written as a grammar over a :class:`Reader`.

A subclass names the markers that open a block (:attr:`openers`) and writes
:meth:`StreamingToolParser.parse_block`, a generator that reads one block and
reports through :meth:`begin_call`, :meth:`call_args` and :meth:`commit`. The
base class does the rest, the same way for every family:

- content outside blocks is passed on, a partial opener held back;
- ``incremental`` mode sends a call's header when the grammar names it and
  each argument fragment as the grammar writes it; ``whole`` mode keeps calls
  until :meth:`commit` says they can no longer turn back into content;
- when ``parse_block`` returns, raw text after the last commit goes back to
  content (a malformed or truncated block loses no text), and scanning goes
  on at the reader's position, so a broken block never hides later calls.

NOTE: ``parse_block`` must return at the first character that does not fit
(leaving it unconsumed), so a marker there is seen again by the content scan.
"""

from __future__ import annotations

import secrets
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from inference_engine.interfaces.parsers import ParsedDelta, ToolCallDelta, ToolParser
from inference_engine.parsing._driver import ReaderDriven
from inference_engine.parsing._reader import MarkerSet, Reader, Step, until

__all__ = ["DELIVERY_MODES", "StreamingToolParser", "new_call_id", "tool_schemas"]

DELIVERY_MODES = ("incremental", "whole")


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> ``parameters.properties`` of an OpenAI ``tools`` list.

    Accepts dicts (``{"type": "function", "function": {...}}`` or the bare
    function object) and objects with ``model_dump()``.
    """
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        if not isinstance(tool, dict):
            continue
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


class StreamingToolParser(ReaderDriven, ToolParser):
    """Drives a block grammar over the content stream; see the module docstring."""

    # Markers that open a block in content (the grammar sees which one matched).
    openers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None,
                 mode: str = "incremental",
                 call_id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(tokenizer, tools, mode)
        if mode not in DELIVERY_MODES:
            raise ValueError(f"tool-call streaming mode must be one of {DELIVERY_MODES}, "
                             f"got {mode!r} (--tool-call-streaming)")
        # Tool name -> JSON schema properties of its parameters.
        self.schemas = tool_schemas(self.tools)
        self._new_id = call_id_factory or new_call_id
        self._reader = Reader()
        self._opener_set = MarkerSet(self.openers)
        self._grammar = self._run()
        self._is_finished = False
        # Output of the current feed.
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        # Whole mode: calls of the open block not yet committed, [name, fragments].
        self._pending: list[tuple[str, list[str]]] = []
        self._in_block = False
        # Absolute positions: last commit (or block start), and last emission.
        self._revert_pos = 0
        self._emit_pos = 0
        self._num_calls = 0
        self._current_index = -1

    # ----------------------------------------------------------------- driver

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        """Consume one content delta; return content and tool-call deltas now certain."""
        self._feed_text(text)
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of stream: flush held text; unfinished blocks become content."""
        self._end_stream()
        return self._take()

    def _step(self) -> None:
        try:
            self._grammar.send(None)
        except StopIteration:
            pass
        r = self._reader
        r.trim(self._revert_pos if self._in_block else r.pos)

    def _take(self) -> ParsedDelta:
        delta = ParsedDelta(content="".join(self._content), tool_calls=self._deltas)
        self._content, self._deltas = [], []
        return delta

    def _add_content(self, text: str) -> None:
        self._content.append(text)

    def _run(self) -> Step:
        r = self._reader
        while True:
            marker = yield from until(r, self._opener_set, self._add_content)
            if marker is None:
                return None
            self._in_block = True
            self._revert_pos = r.pos - len(marker)
            yield from self.parse_block(r, marker)
            start = self._revert_pos
            if self.mode == "incremental":
                start = max(start, self._emit_pos)
            if r.pos > start:
                self._add_content(r.raw(start, r.pos))
            self._pending.clear()
            self._in_block = False

    # ------------------------------------------------------- grammar interface

    @abstractmethod
    def parse_block(self, r: Reader, opener: str) -> Step:
        """Read one block whose ``opener`` marker was just consumed.

        Report each call with :meth:`begin_call` (once its name is complete)
        and :meth:`call_args` (canonical JSON fragments of its arguments), and
        call :meth:`commit` when the calls so far are certain (rule 5 of the
        format spec) and again after trailing markup that belongs to them.
        Return at the first character that does not fit, leaving it unread.
        """

    def begin_call(self, name: str) -> None:
        """A call named ``name`` starts; its arguments follow via :meth:`call_args`."""
        if self.mode == "whole":
            self._pending.append((name, []))
            return
        self._current_index = self._num_calls
        self._num_calls += 1
        self._deltas.append(ToolCallDelta(self._current_index, self._new_id(), name, ""))
        self._emit_pos = self._reader.pos

    def call_args(self, text: str) -> None:
        """Append a fragment of the current call's arguments JSON text."""
        if not text:
            return
        if self.mode == "whole":
            self._pending[-1][1].append(text)
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self._current_index and last.id is None:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(self._current_index, arguments=text))
        self._emit_pos = self._reader.pos

    def commit(self) -> None:
        """Everything read so far in this block is final: send kept calls, move the revert point."""
        for name, fragments in self._pending:
            self._deltas.append(
                ToolCallDelta(self._num_calls, self._new_id(), name, "".join(fragments)))
            self._num_calls += 1
        self._pending.clear()
        self._revert_pos = self._reader.pos

    def param_schema(self, function: str, param: str) -> dict[str, Any] | None:
        """The JSON schema of ``param`` of tool ``function``; None when unknown."""
        schema = self.schemas.get(function, {}).get(param)
        return schema if isinstance(schema, dict) else None
