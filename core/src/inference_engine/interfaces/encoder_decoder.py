"""Encoder-decoder models (Whisper): an encoder run once per request, a paged decoder.

The decoder is an ordinary :class:`CausalLM` over the flattened step (its
self-attention K/V in the paged pool). What it adds is the encoder output its
cross-attention reads, kept as per-sequence state of a fixed size in the engine's
state pool (its layers declare a
:class:`~inference_engine.interfaces.state_cache.StateCacheSpec`). Before each
forward the model runner hands the model the encoder inputs of the sequences
that start this step (no computed context: first step, or first after a
preemption); the model encodes them and writes the result into those
sequences' slots. The slot goes back with the request's blocks, so nothing is
kept per request outside the engine's pools.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import CausalLM

__all__ = ["EncoderDecoderLM"]


class EncoderDecoderLM(CausalLM):
    """A :class:`CausalLM` whose decoder cross-attends encoder states in the state pool."""

    @abstractmethod
    def prepare_encoder(self, encoder_inputs: Sequence[Any] | None,
                        metadata: AttentionMetadata) -> None:
        """Called before each forward: encode the sequences that start this step.

        Runs the encoder (batched) on every non-None input and writes what the
        cross-attention reads into those sequences' ``metadata.state_slots``.

        Args:
            encoder_inputs: per sequence in row order, its encoder input (Whisper:
                ``[n_mels, frames]`` features) where the sequence has no computed context,
                None where its slot already holds its state; None for a step with nothing
                to encode (a profiling step, or only continuing sequences).
            metadata: the step's attention metadata (its ``state_slots``).
        """

    @staticmethod
    def encoder_input_error(encoder_inputs: Any) -> str | None:
        """Why ``encoder_inputs`` cannot be used (a message for a 400), or None if it can."""
        return None if encoder_inputs is not None else "this model needs encoder inputs (audio)"
