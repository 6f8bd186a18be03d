"""What generation returns, shaped like vLLM's outputs so callers can switch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    # Per generated token: {token_id: Logprob} with the sampled token and the top-N.
    logprobs: list[dict[int, Any]] | None = None
    # "stop", "length", "abort", or None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it (None for EOS / length).
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step (streaming) or at the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # Set when the engine had to end the request for a reason the client should see.
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
