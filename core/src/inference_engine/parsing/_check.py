"""What ``inference-engine parse`` computes: a parser run over a saved output.

Kept out of the CLI module so the CLI stays a thin typer wrapper and tests can
call it directly.
"""

from __future__ import annotations

import random
from typing import Any

from inference_engine.parsing._pipeline import PipelineFactory

__all__ = ["chunk_text", "run_parse"]


def chunk_text(text: str, chunk_size: int | None = None, seed: int | None = None) -> list[str]:
    """Split ``text`` into deltas: fixed ``chunk_size``, or random sizes 1-16 from ``seed``."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"--chunk-size must be at least 1, got {chunk_size}")
        return [text[i: i + chunk_size] for i in range(0, len(text), chunk_size)]
    if seed is None:
        return [text]
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(text):
        size = rng.randint(1, 16)
        chunks.append(text[i: i + size])
        i += size
    return chunks


def run_parse(text: str, *, tool_parser: str | None, reasoning_parser: str | None = None,
              tools: list[dict[str, Any]] | None = None, chunk_size: int | None = None,
              stream_seed: int | None = None, mode: str = "incremental",
              enable_thinking: bool | None = None, registry: Any = None) -> dict[str, Any]:
    """Parse one saved output the way ``inference-engine parse`` prints it.

    Args:
        text: the model's raw output.
        tool_parser: ``--tool-parser`` name, or None.
        reasoning_parser: ``--reasoning-parser`` name, or None.
        tools: the OpenAI ``tools`` list (``--tools FILE.json``).
        chunk_size: stream in deltas of this many characters (``--chunk-size``).
        stream_seed: stream in random deltas from this seed (``--stream-random``).
        mode: ``incremental`` or ``whole``; used only when streaming.
        enable_thinking: ``--thinking/--no-thinking``; None for the parser default.
        registry: where names resolve; default the process's plugins.

    Returns:
        ``{"reasoning": str|None, "content": str|None,
        "tool_calls": [{"name": str, "arguments": object}]}``; without a chunk
        size or seed, the non-streaming parse.
    """
    factory = PipelineFactory(tool_parser, reasoning_parser, mode, registry)
    request = {"tools": tools, "enable_thinking": enable_thinking}
    if chunk_size is None and stream_seed is None:
        return factory.parse(text, **request).simple()
    pipeline = factory.create(**request)
    for chunk in chunk_text(text, chunk_size, stream_seed):
        pipeline.feed(chunk)
    pipeline.finish()
    return pipeline.result().simple()
