"""What the engine keeps per request to report it, apart from what the scheduler needs.

The scheduler's :class:`~inference_engine.engine.request.Request` holds scheduling facts
only (tokens, cache progress, status). Everything about turning a sequence into
outputs lives here: its place in the user's request (``n`` samples form a group), the
incremental detokenizer, how far stop strings have been scanned, the text cut at a stop
string, logprobs and an error to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference_engine.engine.request import Request

__all__ = ["RequestGroup", "SequenceState"]


@dataclass(eq=False)
class SequenceState:
    """One sampled sequence of a user request, as the engine reports it."""

    request: Request
    group: RequestGroup
    # Index among the group's ``n`` samples (CompletionOutput.index).
    index: int
    detokenizer: Any
    # Characters of the detokenized text already scanned for stop strings.
    checked_len: int = 0
    # The text cut at a stop string, once one is found.
    final_text: str | None = None
    # Why the engine ended it on its own (e.g. too long for the whole KV pool).
    error: str | None = None
    # Per sampled token {token_id: Logprob}, when the request asked for logprobs.
    logprobs: list[dict[int, Any]] | None = None
    # Per prompt token (None first), when the request asked for prompt_logprobs.
    prompt_logprobs: list[dict[int, Any] | None] | None = None

    def __post_init__(self) -> None:
        if self.request.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []


@dataclass(eq=False)
class RequestGroup:
    """A user request: its prompt and the ``n`` sequences sampled for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[SequenceState] = field(default_factory=list)
    num_cached_tokens: int = 0
    reported_finished: bool = False
    # Report only the finished output (offline generate): no per-step outputs, and text
    # detokenized once at the end unless stop strings need it as it grows.
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)
