"""What the engine keeps per request to report it, apart from what the scheduler needs.

The scheduler's :class:`~inference_engine.engine.request.Request` holds scheduling facts
only (tokens, cache progress, status). Everything about turning a sequence into
outputs lives here: its place in the user's request (``n`` samples form a group), the
incremental detokenizer, how far stop strings have been scanned, the text cut at a stop
string, logprobs and an error to report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inference_engine.engine.request import Request, RequestStatus

__all__ = ["OutputsWithPending", "RequestGroup", "SequenceState", "StopPrefixes"]


class StopPrefixes:
    """How much of each stop string the text ends with, kept up to date as the text grows.

    A stream holds back the longest such tail (it may yet become a stop string).
    Recomputing it from scratch costs up to a stop's length squared per step;
    kept incrementally it costs about the new characters per stop: if the text
    ends with ``stop[:k]`` after ``d`` new characters, the text before them ended
    with ``stop[:k - d]``, so ``k`` is at most the previous length plus ``d``.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self.stop_strings = tuple(stop_strings)
        # Per stop string: the longest proper prefix the text ends with.
        self.lengths = [0] * len(self.stop_strings)
        self.scanned = 0

    def holdback(self, text: str) -> int:
        """Trailing characters of ``text`` that are the start of some stop string.

        ``text`` must extend the text of the previous call (output text only grows).
        """
        new = len(text) - self.scanned
        if new < 0:  # not an extension: start over
            self.lengths = [0] * len(self.stop_strings)
            new = len(text)
        if new:
            for i, stop in enumerate(self.stop_strings):
                k = min(self.lengths[i] + new, len(stop) - 1, len(text))
                while k > 0 and not text.endswith(stop[:k]):
                    k -= 1
                self.lengths[i] = k
            self.scanned = len(text)
        return max(self.lengths, default=0)


class OutputsWithPending(Sequence[int]):
    """A request's output ids followed by ``-1`` for each token still on the device (async
    scheduling), without copying the ids: the sampler reads their length every step (the
    seeded draw number, min_tokens) and their values only where no token is pending."""

    __slots__ = ("_ids", "_num_pending")

    def __init__(self, ids: list[int], num_pending: int) -> None:
        self._ids = ids
        self._num_pending = num_pending

    def __len__(self) -> int:
        return len(self._ids) + self._num_pending

    def __getitem__(self, index: int | slice) -> int | list[int]:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("output index out of range")
        return self._ids[index] if index < len(self._ids) else -1


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
    # Stop-string tails of the text, when the request has stop strings.
    stop_prefixes: StopPrefixes | None = None
    # Characters and tokens already reported (outputs of RequestOutputKind.DELTA requests).
    reported_chars: int = 0
    reported_tokens: int = 0
    # ``request.max_new_tokens()`` (fixed once the request is made), read at every token.
    max_new_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_new_tokens = self.request.max_new_tokens()
        if self.request.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.request.params.stop and self.stop_prefixes is None:
            self.stop_prefixes = StopPrefixes(self.request.params.stop)

    def stop_holdback(self, text: str) -> int:
        """Characters at the end of ``text`` (this sequence's growing text) a stream holds back."""
        return self.stop_prefixes.holdback(text) if self.stop_prefixes is not None else 0


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
    # Report only what is new since the previous output (RequestOutputKind.DELTA).
    delta: bool = False
    # Whether the prompt logprobs went out already (a delta request reports them once).
    reported_prompt: bool = False

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:  # n = 1, the common case, asked about every step
            return children[0].request.status is RequestStatus.FINISHED
        return all(c.request.is_finished for c in children)
