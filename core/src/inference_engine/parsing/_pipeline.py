"""Reasoning parser + tool parser over one response: the object the server drives.

Reasoning is split first; its content goes to the tool parser. Streaming and
non-streaming are the same machine: :meth:`ParserPipeline.feed` per delta and
:meth:`ParserPipeline.finish` at the end, or :meth:`PipelineFactory.parse` for
a whole text (always in ``whole`` delivery mode, so a truncated call is content
as the format spec's rule 5 says).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from inference_engine.interfaces.parsers import ParsedDelta, ReasoningParser, ToolParser
from inference_engine.parsing._result import DeltaAccumulator, ParseResult
from inference_engine.parsing._tool_base import DELIVERY_MODES

__all__ = [
    "ParserPipeline",
    "PipelineFactory",
    "ToolChoiceError",
    "build_pipeline",
    "check_tool_choice",
    "parse_output",
    "thinking_from_kwargs",
]


class ToolChoiceError(ValueError):
    """The output does not satisfy ``tool_choice`` (``required`` or a named function)."""


def thinking_from_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> bool | None:
    """The request's thinking switch: ``enable_thinking``, else ``thinking``, else None.

    GLM and DeepSeek-V3.1 templates read ``thinking``; the others
    ``enable_thinking``. None lets the reasoning parser use its default.
    """
    kwargs = chat_template_kwargs or {}
    for key in ("enable_thinking", "thinking"):
        if kwargs.get(key) is not None:
            return bool(kwargs[key])
    return None


def _normalize_tool_choice(tool_choice: Any) -> str | dict[str, Any]:
    if tool_choice is None:
        return "auto"
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump()
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return tool_choice
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


def check_tool_choice(tool_choice: Any, tool_calls: Sequence[dict[str, Any]]) -> str | None:
    """Why ``tool_calls`` break ``tool_choice``, or None when they satisfy it.

    Enforced by parsing only (no guided decoding yet): ``required`` needs at
    least one call; a named function needs at least one call, all to it.
    """
    choice = _normalize_tool_choice(tool_choice)
    if choice in ("auto", "none"):
        return None
    if not tool_calls:
        wanted = "a tool call" if choice == "required" else \
            f"a call to {choice['function']['name']!r}"
        return f"tool_choice requires {wanted} but the model produced none"
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        others = sorted({c["function"]["name"] for c in tool_calls} - {name})
        if others:
            return f"tool_choice names {name!r} but the model called {', '.join(others)}"
    return None


class ParserPipeline:
    """The per-request parser: reasoning split, then tool calls, as OpenAI-shaped deltas."""

    def __init__(self, reasoning_parser: ReasoningParser | None = None,
                 tool_parser: ToolParser | None = None, tool_choice: Any = "auto") -> None:
        """Args:
            reasoning_parser: a fresh parser for this request, or None for no split.
            tool_parser: a fresh parser for this request, or None for no tool calls.
            tool_choice: the request's ``tool_choice``; only checked by
                :meth:`tool_choice_error`.
        """
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.tool_choice = _normalize_tool_choice(tool_choice)
        if reasoning_parser is not None and tool_parser is not None:
            reasoning_parser.set_call_openers(tool_parser.call_openers)
        self._accumulator = DeltaAccumulator()
        self._is_finished = False

    def feed(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> ParsedDelta:
        """Consume one generated delta; return what is now certain (maybe empty).

        Args:
            delta_text: the newly detokenized text.
            delta_token_ids: the token ids behind it (passed to both parsers).
        """
        if self._is_finished:
            raise RuntimeError("feed() after finish()")
        if self.reasoning_parser is None:
            out = ParsedDelta(content=delta_text)
        else:
            out = self.reasoning_parser.feed(delta_text, delta_token_ids)
        return self._through_tools(out, delta_token_ids, is_last=False)

    def finish(self) -> ParsedDelta:
        """End of stream: flush everything held back; call exactly once."""
        if self._is_finished:
            raise RuntimeError("finish() called twice")
        self._is_finished = True
        out = ParsedDelta() if self.reasoning_parser is None else self.reasoning_parser.finish()
        return self._through_tools(out, (), is_last=True)

    def _through_tools(self, out: ParsedDelta, token_ids: Sequence[int],
                       is_last: bool) -> ParsedDelta:
        if self.tool_parser is not None:
            content, calls = out.content, list(out.tool_calls)
            out.content = ""
            if content:
                parsed = self.tool_parser.feed(content, token_ids)
                out.content += parsed.content
                calls += parsed.tool_calls
            if is_last:
                parsed = self.tool_parser.finish()
                out.content += parsed.content
                calls += parsed.tool_calls
            out.tool_calls = calls
        self._accumulator.add(out)
        return out

    def result(self) -> ParseResult:
        """What all deltas so far add up to (the non-streaming message after finish)."""
        return self._accumulator.result()

    def tool_choice_error(self) -> str | None:
        """After :meth:`finish`: why the calls break ``tool_choice``, or None."""
        return check_tool_choice(self.tool_choice, self.result().tool_calls)


def _construct(cls: type, **kwargs: Any) -> Any:
    """Instantiate a parser class with the keyword arguments its constructor accepts."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return cls(**kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return cls(**kwargs)
    return cls(**{k: v for k, v in kwargs.items() if k in parameters})


class PipelineFactory:
    """Parser classes resolved once (server start), pipelines made per request."""

    def __init__(self, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 mode: str = "incremental", registry: Any = None) -> None:
        """Args:
            tool_parser: registered tool-parser name (``--tool-call-parser``) or None.
            reasoning_parser: registered reasoning-parser name (``--reasoning-parser``) or None.
            mode: ``incremental`` or ``whole`` (``--tool-call-streaming``).
            registry: where names resolve; default the process's plugins.

        Raises:
            UnknownNameError: a name nobody registered (lists the registered ones).
            ValueError: an unknown ``mode``.
        """
        if mode not in DELIVERY_MODES:
            raise ValueError(f"--tool-call-streaming must be one of {DELIVERY_MODES}, got {mode!r}")
        if registry is None:
            from inference_engine.plugins import get_plugins

            registry = get_plugins().registry
        self.tool_parser_name = tool_parser
        self.reasoning_parser_name = reasoning_parser
        self.mode = mode
        self.tool_parser_cls = registry.resolve("tool_parsers", tool_parser) \
            if tool_parser else None
        self.reasoning_parser_cls = registry.resolve("reasoning_parsers", reasoning_parser) \
            if reasoning_parser else None

    def create(self, *, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None,
               tool_choice: Any = "auto", enable_thinking: bool | None = None,
               mode: str | None = None,
               call_id_factory: Callable[[], str] | None = None) -> ParserPipeline:
        """A fresh pipeline for one request (one choice).

        Args:
            tokenizer: the model's tokenizer, or None (the built-in parsers are text-level).
            tools: the request's OpenAI ``tools`` (schemas type XML arguments).
            tool_choice: ``auto``/``none``/``required``/named; ``none`` turns
                tool parsing off, the others parse.
            enable_thinking: see :func:`thinking_from_kwargs`; None for the parser default.
            mode: overrides the factory's delivery mode.
            call_id_factory: makes tool-call ids (default ``call_<24 hex>``).
        """
        choice = _normalize_tool_choice(tool_choice)
        reasoning = None
        if self.reasoning_parser_cls is not None:
            reasoning = _construct(self.reasoning_parser_cls, tokenizer=tokenizer,
                                   enable_thinking=enable_thinking)
        tool = None
        if self.tool_parser_cls is not None and choice != "none":
            kwargs: dict[str, Any] = {"tokenizer": tokenizer, "tools": tools,
                                      "mode": mode or self.mode}
            if call_id_factory is not None:
                kwargs["call_id_factory"] = call_id_factory
            tool = _construct(self.tool_parser_cls, **kwargs)
        return ParserPipeline(reasoning, tool, choice)

    def parse(self, text: str, **request: Any) -> ParseResult:
        """Non-streaming parse of a whole output; keyword arguments as :meth:`create`."""
        request["mode"] = "whole"
        pipeline = self.create(**request)
        pipeline.feed(text)
        pipeline.finish()
        return pipeline.result()


def build_pipeline(tool_parser: str | None = None, reasoning_parser: str | None = None, *,
                   mode: str = "incremental", registry: Any = None,
                   **request: Any) -> ParserPipeline:
    """One-off :class:`PipelineFactory` ``(...).create(**request)``."""
    return PipelineFactory(tool_parser, reasoning_parser, mode, registry).create(**request)


def parse_output(text: str, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, *, registry: Any = None,
                 **request: Any) -> ParseResult:
    """One-off non-streaming parse: ``PipelineFactory(...).parse(text, **request)``."""
    return PipelineFactory(tool_parser, reasoning_parser, "whole", registry).parse(text, **request)
