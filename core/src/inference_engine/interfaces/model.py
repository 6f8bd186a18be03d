"""What a model plugin's class receives and must provide."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from inference_engine.interfaces.attention import AttentionBackend, AttentionMetadata
    from inference_engine.interfaces.quant import QuantMethod

__all__ = ["CausalLM", "ModelContext"]


@dataclass
class ModelContext:
    """Everything a model needs to build its layers."""

    # transformers PretrainedConfig of the checkpoint.
    hf_config: Any
    # Compute dtype of weights and activations.
    dtype: torch.dtype
    # Quantization method owning every linear layer's weights.
    quant_method: QuantMethod
    # Attention backend class each attention layer instantiates.
    attention_backend: type[AttentionBackend]
    device: torch.device
    # Longest context the engine will run (``--max-model-len``); position tables
    # must cover it even where it exceeds the config's max_position_embeddings.
    max_model_len: int = 0
    # Element type of the attention layers' KV cache; None: ``dtype``.
    kv_cache_dtype: torch.dtype | None = None
    # attention_backend="auto": the platform's backends, best first; each attention layer
    # takes the first that supports it. Empty: every layer uses ``attention_backend``.
    attention_backend_candidates: tuple[type[AttentionBackend], ...] = ()


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over the flattened batch of one step."""

    # Several greedy decode steps of one sequence in one call
    # (:class:`~inference_engine.layers.cpu_greedy_window.CpuGreedyWindow`), bound in
    # kv_cache_bound by the models that have one; None: one step per engine step.
    greedy_window: Any = None

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.ctx = ctx

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` for token ids/positions ``[num_tokens]``."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` for selected hidden states ``[n, hidden]``."""

    def kv_cache_bound(self) -> None:
        """Called by the model runner after it binds the attention layers' caches, and after
        it drops them: a model may bind per-cache state here (the CPU decode step does).
        Nothing by default."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by checkpoint name; return the names consumed.

        Raises:
            ValueError: naming unexpected tensors or shape mismatches.
        """
