"""Encoder-decoder models (Whisper): an encoder run once per request, a paged decoder.

The decoder is an ordinary :class:`CausalLM` over the flattened step (its
self-attention K/V in the paged pool); what it adds is per-request encoder
state that its cross-attention reads. The model runner tells the model, before
each forward, which request each sequence of the step belongs to and hands it
the encoder inputs of requests it has not encoded yet; the engine tells it when
a request is gone so the state is freed.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from inference_engine.interfaces.model import CausalLM

__all__ = ["EncoderDecoderLM"]


class EncoderDecoderLM(CausalLM):
    """A :class:`CausalLM` whose decoder cross-attends per-request encoder states."""

    @abstractmethod
    def prepare_encoder(self, request_ids: Sequence[str] | None,
                        encoder_inputs: Sequence[Any] | None) -> None:
        """Called before each forward with the step's sequences in row order.

        Runs the encoder (batched) for the requests it has no state for yet and
        remembers the row order for the forward's cross-attention.

        Args:
            request_ids: each scheduled sequence's request id; None for a dummy
                (profiling) step without requests.
            encoder_inputs: each sequence's encoder input (Whisper: ``[n_mels, frames]``
                features), parallel to ``request_ids``.

        Raises:
            ValueError: a sequence that has neither encoder state nor an input.
        """

    @abstractmethod
    def release_encoder(self, request_id: str) -> None:
        """Free the request's encoder state (finished or aborted); unknown ids are ignored."""

    @property
    def num_encoder_states(self) -> int:
        """Requests whose encoder state is held (for tests and stats)."""
        return 0

    @staticmethod
    def encoder_input_error(encoder_inputs: Any) -> str | None:
        """Why ``encoder_inputs`` cannot be used (a message for a 400), or None if it can."""
        return None if encoder_inputs is not None else "this model needs encoder inputs (audio)"
