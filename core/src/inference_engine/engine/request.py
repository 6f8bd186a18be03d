"""One sequence's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from inference_engine.sampling_params import SamplingParams

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """A sequence as the scheduler sees it: prompt, generated tokens and how much of it
    the cache holds (what the engine reports lives in ``output_state.SequenceState``).

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the
    scheduler advances it, preemption resets it to zero (recompute).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Token ids that end the sequence (EOS from generation_config + stop_token_ids).
    eos_token_ids: frozenset[int] = frozenset()
    # Context limit: prompt + output never exceed it.
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by a step still running on the device (async scheduling): they
    # count for scheduling (the next step feeds them from the device) but are not in
    # ``output_token_ids`` until read back (:meth:`append_token` resolves one).
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # The stop string or token id that ended it.
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Speculative decoding: draft tokens the next step verifies after the last known one
    # (unverified: never in ``all_token_ids``, never hashed into the prefix cache).
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (``inference_engine.lora.adapter.LoRAAdapter``); None:
    # the base model.
    lora: Any = None
    # Block diffusion (``inference_engine.diffusion.DiffusionState``): its canvas and denoising
    # state; None for an autoregressive request.
    diffusion: Any = None
    # Encoder-decoder models (Whisper): the input its encoder runs on once (log-mel
    # features); None for a decoder-only request.
    encoder_inputs: Any = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens, those still being sampled on the device included."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return 0 if self.lora is None else self.lora.request.lora_int_id

    @property
    def prefix_salt(self) -> int | None:
        """Seeds its prefix-cache keys: K/V computed under an adapter is reused only by
        requests with the same adapter. A request with encoder inputs salts them with its
        own id and arrival: its decoder K/V depend on its audio, so only it (after a
        preemption) may reuse them, even where the decoder prompt is the same."""
        if self.encoder_inputs is not None:
            return hash(("encoder", self.request_id, self.arrival_time))
        return None if self.lora is None else self.lora.request.prefix_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token (resolving a pending one, if any)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1

    def will_stop_by_length(self) -> bool:
        """Whether the tokens known or pending already reach max_tokens or the context
        limit: the request ends when they are read back, so it is not scheduled again."""
        pending = self.num_pending_tokens
        num_out = len(self.output_token_ids) + pending
        # max_new_tokens() written out: the scheduler asks this of every row that runs ahead.
        room = self.max_model_len - len(self.prompt_token_ids)
        limit = self.params.max_tokens
        return (num_out >= (room if limit is None or limit > room else limit)
                or len(self.all_token_ids) + pending >= self.max_model_len)

    def max_new_tokens(self) -> int:
        room = self.max_model_len - self.num_prompt_tokens
        limit = self.params.max_tokens
        return room if limit is None else min(limit, room)
