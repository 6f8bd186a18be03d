"""Token embedding and the LM head (optionally tied to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LMHead", "VocabEmbedding"]


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to float32 logits; shares the embedding matrix when tied."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype,
                 tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden, dtype=dtype),
                                       requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
