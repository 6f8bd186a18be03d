"""Streaming machinery shared by tool-call and reasoning parsers.

The server builds a :class:`PipelineFactory` once from ``--tool-call-parser``,
``--reasoning-parser`` and ``--tool-call-streaming``, then per request calls
``factory.create(...)`` and feeds each generated delta to the pipeline;
:func:`to_openai_delta` turns each :class:`ParsedDelta` into a chunk's delta.
Parser authors build on :class:`StreamingToolParser` / :class:`ThinkReasoningParser`
and the :class:`Reader` primitives; see ``docs/parsers.md``.
"""

from __future__ import annotations

from inference_engine.interfaces.parsers import (
    CallOpener,
    ParsedDelta,
    ReasoningParser,
    ToolCallDelta,
    ToolParser,
)
from inference_engine.parsing._check import chunk_text, run_parse
from inference_engine.parsing._defaults import ARCHITECTURE_PARSERS, default_parsers
from inference_engine.parsing._json_stream import JsonStreamer, json_string, json_value
from inference_engine.parsing._pipeline import (
    ParserPipeline,
    PipelineFactory,
    ToolChoiceError,
    build_pipeline,
    check_tool_choice,
    parse_output,
    thinking_from_kwargs,
)
from inference_engine.parsing._reader import (
    MarkerSet,
    Reader,
    Step,
    copy_all,
    followed_by,
    match,
    match_after_ws,
    match_any,
    match_any_after_ws,
    peek,
    read_until_char,
    skip_ws,
    until,
)
from inference_engine.parsing._result import DeltaAccumulator, ParseResult, to_openai_delta
from inference_engine.parsing._think import ThinkReasoningParser
from inference_engine.parsing._tool_base import (
    DELIVERY_MODES,
    StreamingToolParser,
    new_call_id,
    tool_schemas,
)

__all__ = [
    "ARCHITECTURE_PARSERS",
    "DELIVERY_MODES",
    "CallOpener",
    "DeltaAccumulator",
    "JsonStreamer",
    "MarkerSet",
    "ParseResult",
    "ParsedDelta",
    "ParserPipeline",
    "PipelineFactory",
    "Reader",
    "ReasoningParser",
    "Step",
    "StreamingToolParser",
    "ThinkReasoningParser",
    "ToolCallDelta",
    "ToolChoiceError",
    "ToolParser",
    "build_pipeline",
    "check_tool_choice",
    "chunk_text",
    "copy_all",
    "default_parsers",
    "followed_by",
    "json_string",
    "json_value",
    "match",
    "match_after_ws",
    "match_any",
    "match_any_after_ws",
    "new_call_id",
    "parse_output",
    "peek",
    "read_until_char",
    "run_parse",
    "skip_ws",
    "thinking_from_kwargs",
    "to_openai_delta",
    "tool_schemas",
    "until",
]
