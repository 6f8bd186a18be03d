"""Per-request sampling and stopping options, named as in vLLM so users can switch."""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from inference_engine.structured_output.params import StructuredOutputsParams

__all__ = ["GREEDY_EPS", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

# Temperatures below this mean greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each streamed :class:`~inference_engine.outputs.RequestOutput` holds (vLLM's enum)."""

    # Everything generated so far (text, token ids, logprobs) in every output.
    CUMULATIVE = 0
    # Only what is new since the request's previous output (prompt logprobs in the first).
    DELTA = 1
    # One output, when the request finishes.
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Logits are processed in this order (vLLM's and transformers' order): the masks
    (structured-output grammar, ``allowed_token_ids``, ``bad_words``, min_tokens),
    ``logit_bias``, repetition/presence/frequency penalties, temperature, top-k, top-p,
    min-p, then a draw. Reported ``logprobs`` are the model's raw distribution
    (log-softmax before any of that processing), as vLLM reports by default.

    ``n > 1`` is served by forking ``n`` sequences; sample ``i`` of a seeded
    request uses ``seed + i`` (see :meth:`for_sample`).

    Raises:
        ValueError: a field out of range; the message names the field.
    """

    # Number of independent samples (completions) to return for the prompt.
    n: int = 1
    # Softmax temperature; below GREEDY_EPS (e.g. 0) means greedy decoding.
    temperature: float = 1.0
    # Nucleus sampling: keep the most likely tokens holding this much probability; 1 = off.
    top_p: float = 1.0
    # Keep only the k most likely tokens; 0 or -1 = off (stored as 0).
    top_k: int = 0
    # Drop tokens whose probability is below min_p times the top token's; 0 = off.
    min_p: float = 0.0
    # transformers' rule over prompt + output tokens: > 1 discourages repeats; 1 = off.
    repetition_penalty: float = 1.0
    # OpenAI's rule over output tokens: subtracted once from every token already generated.
    presence_penalty: float = 0.0
    # OpenAI's rule over output tokens: subtracted once per earlier occurrence.
    frequency_penalty: float = 0.0
    # Makes this request's draws depend only on the seed and its own position.
    seed: int | None = None
    # Most tokens to generate; None = until the context limit.
    max_tokens: int | None = 16
    # EOS and stop_token_ids are masked out until this many tokens are generated.
    min_tokens: int = 0
    # Strings that end generation; normalised to a list (or None).
    stop: list[str] | str | None = None
    # Token ids that end generation (in addition to EOS unless ignore_eos).
    stop_token_ids: list[int] | None = None
    # Keep generating past EOS (stop_token_ids still stop).
    ignore_eos: bool = False
    # Top-N raw logprobs per generated token (the sampled token is always included);
    # -1 = the whole vocabulary.
    logprobs: int | None = None
    # Top-N raw logprobs per prompt token (the prompt token is always included); -1 = all.
    prompt_logprobs: int | None = None
    # Leave special tokens out of the output text.
    skip_special_tokens: bool = True
    # Only False is refused: fast tokenizers always join special tokens without spaces.
    spaces_between_special_tokens: bool = True
    # False: token ids only, no text (nothing is decoded; stop strings need text).
    detokenize: bool = True
    # Constrain the output to a JSON schema, any JSON, a regex, a choice or an EBNF grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # {token id: bias} added to the logits (OpenAI's range: -100 bans, 100 forces).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: a word's last token is banned where the output ends with
    # the rest of it (vLLM's rule); tokenized by :meth:`update_from_tokenizer`.
    bad_words: list[str] | None = None
    # Keep only the last k prompt tokens (-1: as many as the context allows).
    truncate_prompt_tokens: int | None = None
    # Keep the matched stop string at the end of the output text.
    include_stop_str_in_output: bool = False
    # Free-form extras for plugins; the core never reads them.
    extra_args: dict[str, Any] = field(default_factory=dict)
    # bad_words as token-id sequences (both with and without a leading space).
    bad_words_token_ids: list[list[int]] | None = None
    # What each streamed output holds: everything so far, only the new part, or one at the end.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None:
            self.stop = list(self.stop)
            if not self.stop:
                self.stop = None
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
            if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
                raise ValueError(
                    f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
                )
        if self.top_k == -1:
            self.top_k = 0
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind (0 cumulative, 1 delta, "
                             f"2 final only), got {self.output_kind!r}") from None
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
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
            (self.logprobs is None or self.logprobs >= -1,
             f"logprobs must be non-negative or -1 (all), got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= -1,
             f"prompt_logprobs must be non-negative or -1 (all), got {self.prompt_logprobs}"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1
             or self.truncate_prompt_tokens == -1,
             f"truncate_prompt_tokens must be at least 1 or -1, got "
             f"{self.truncate_prompt_tokens}"),
            (self.detokenize or self.stop is None,
             "detokenize must be true when stop strings are given (they are matched on text)"),
            (self.spaces_between_special_tokens is True,
             "spaces_between_special_tokens must be true: false is not supported (fast "
             "tokenizers join special tokens without spaces)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_token_fields()

    def _check_token_fields(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.logit_bias is not None:
            bias = {}
            for token, value in dict(self.logit_bias).items():
                key = int(token) if isinstance(token, str) and token.lstrip("-").isdigit() \
                    else token
                if not _is_int(key) or key < 0:
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
                if not _is_real(value) or not -100 <= value <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got "
                                     f"{value!r} for token {token}")
                bias[int(key)] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or any(
                    not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r}")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must hold non-empty strings, got {self.bad_words!r}")

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int) -> None:
        """Check token ids against the vocabulary and tokenize ``bad_words`` (vLLM's rule:
        each word as written and with one leading space).

        Raises:
            ValueError: a token id of ``logit_bias``/``allowed_token_ids`` outside the
                vocabulary (names the field).
        """
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary "
                                 f"[0, {vocab_size}): {bad[:8]}")
        if not self.bad_words or self.bad_words_token_ids is not None:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for prefix in ("", " "):
                ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        self.bad_words_token_ids = sequences

    @property
    def is_greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature below GREEDY_EPS)."""
        return self.temperature < GREEDY_EPS

    # Older name, kept for callers written against it.
    greedy = is_greedy

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self) -> SamplingParams:
        """A deep copy (``extra_args`` included)."""
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> SamplingParams:
        """Params of the ``index``-th of ``n`` forked samples.

        The child has ``n=1`` and, when the request is seeded, ``seed + index``,
        so each child has its own reproducible stream. NOTE: child 1 of seed 5
        therefore draws what child 0 of seed 6 draws (as in vLLM).
        """
        child = self.clone()
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
