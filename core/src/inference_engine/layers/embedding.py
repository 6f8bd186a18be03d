"""Token embedding and the LM head (optionally tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.layers.cpu_gemv import bf16_gemv_weight, small_batch_linear

__all__ = ["LMHead", "VocabEmbedding"]


class VocabEmbedding(nn.Module):
    """``weight [vocab, hidden]`` looked up by token id."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` -> ``[T, hidden]``."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to float32 logits.

    Tied to an embedding, it holds that embedding's very parameter, so
    ``named_parameters()`` lists the matrix once (under the embedding) and a
    checkpoint needs no ``lm_head.weight``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.is_tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                       requires_grad=False)

        self.gemv_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """Keep a bfloat16 copy for decode-sized batches where it is exact (see cpu_gemv)."""
        self.gemv_weight = bf16_gemv_weight(self.weight.data)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, hidden]`` -> float32 logits ``[n, vocab]``."""
        if self.gemv_weight is not None:
            return small_batch_linear(hidden, self.weight, self.gemv_weight,
                                      bf16_gemm=getattr(self, "bf16_gemm", False))
        return F.linear(hidden, self.weight).float()
