"""The JSON call object shared by the JSON grammars: ``{"name": str, "arguments": {...}}``."""

from __future__ import annotations

from inference_engine.parsing import (
    JsonStreamer,
    Reader,
    Step,
    StreamingToolParser,
    json_string,
    json_value,
    match,
    match_any,
    peek,
    skip_ws,
)

__all__ = ["json_call_object"]


def _discard(_: str) -> None:
    pass


def _object_from_string(text: str) -> str | None:
    """Canonical text of the JSON object held in ``text``; None if it holds none."""
    parts: list[str] = []
    streamer = JsonStreamer(parts.append)
    end = streamer.feed(text, 0, eof=True)
    if not streamer.done or streamer.first_char != "{" or text[end:].strip(" \t\n\r"):
        return None
    return "".join(parts)


def json_call_object(parser: StreamingToolParser, r: Reader,
                     allow_string_arguments: bool = False) -> Step:
    """Read one call object at ``r`` (next character ``{``); True if it is a valid call.

    ``name`` must be a non-empty string; ``arguments`` an object (or, with
    ``allow_string_arguments``, a string holding one); missing arguments are
    ``{}``; other keys are checked as JSON and ignored. Arguments stream as
    canonical JSON once the name is known (held until then). On False the
    reader points at the character that broke the call.
    """
    r.i += 1  # "{"
    name: str | None = None
    has_arguments = False
    early: list[str] = []  # arguments written before the name
    is_first = True
    while True:
        yield from skip_ws(r)
        c = yield from peek(r)
        if is_first and c == "}":
            r.i += 1
            break
        if c != '"':
            return False
        key = yield from json_string(r)
        if key is None:
            return False
        yield from skip_ws(r)
        if not (yield from match(r, ":")):
            return False
        yield from skip_ws(r)
        if key == "name" and name is None:
            value = yield from json_string(r)
            if not isinstance(value, str) or not value:
                return False
            name = value
            parser.begin_call(name)
            parser.call_args("".join(early))
        elif key == "arguments" and not has_arguments:
            has_arguments = True
            sink = parser.call_args if name is not None else early.append
            c = yield from peek(r)
            if c == "{":
                if not (yield from json_value(r, sink)):
                    return False
            elif c == '"' and allow_string_arguments:
                text = yield from json_string(r)
                canonical = _object_from_string(text) if text is not None else None
                if canonical is None:
                    return False
                sink(canonical)
            else:
                return False
        elif not (yield from json_value(r, _discard)):
            return False
        is_first = False
        yield from skip_ws(r)
        separator = yield from match_any(r, (",", "}"))
        if separator is None:
            return False
        if separator == "}":
            break
    if name is None:
        return False
    if not has_arguments:
        parser.call_args("{}")
    return True
