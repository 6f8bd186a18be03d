"""Per-request sampling and stopping options, named as in vLLM so users can switch."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

__all__ = ["GREEDY_EPS", "SamplingParams"]

# Temperatures below this mean greedy.
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``top_k`` of 0 or -1 disables it; ``max_tokens=None`` generates up to the
    context limit; ``seed`` makes a request's samples independent of what else
    is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Tokens excluded from stop checks etc. are not configurable here; extras for plugins.
    extra_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None:
            self.stop = list(self.stop)
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be 0 or -1 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be non-negative, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> SamplingParams:
        """Params of the ``index``-th of ``n`` parallel samples (seed + index when seeded)."""
        child = self.clone()
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child
