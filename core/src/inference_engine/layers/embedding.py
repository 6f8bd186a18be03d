"""Token embedding and the LM head (optionally tied to it)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.distributed.parallel_state import parallel_state
from inference_engine.layers.cpu_gemv import bf16_gemv_weight, small_batch_linear

__all__ = ["LMHead", "VocabEmbedding"]


class VocabEmbedding(nn.Module):
    """``weight [vocab, hidden]`` looked up by token id.

    Under tensor parallelism the vocabulary is split in equal contiguous ranges (the last
    padded with zero rows): each rank looks up the ids in its range, zeroes the others'
    rows, and one all-reduce sums the ranks' lookups.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        tp = parallel_state().tp
        self._tp = tp
        # This rank's rows [vocab_start, vocab_start + rows) of the (padded) vocabulary.
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)
        if tp.size > 1:
            self.weight.weight_loader = self._load_rows  # type: ignore[attr-defined]

    def _load_rows(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows of the full checkpoint matrix; zero the padding."""
        _load_vocab_rows(param, loaded, self.vocab_size, self.vocab_start, self.rows_per_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` -> ``[T, hidden]``."""
        if self._tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(1), 0)
        return self._tp.all_reduce(out)


def _load_vocab_rows(param: torch.Tensor, loaded: torch.Tensor, vocab_size: int, start: int,
                     rows: int) -> None:
    if loaded.dim() != 2 or loaded.shape[0] != vocab_size or loaded.shape[1] != param.shape[1]:
        raise ValueError(f"shape mismatch: the checkpoint tensor has shape "
                         f"{tuple(loaded.shape)}, the model expects ({vocab_size}, "
                         f"{param.shape[1]}) split over tensor-parallel ranks")
    n = max(0, min(rows, vocab_size - start))
    param.data[:n].copy_(loaded[start:start + n])
    param.data[n:].zero_()


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
        tp = parallel_state().tp
        self._tp = tp
        # Under tensor parallelism: this rank's vocabulary rows, as VocabEmbedding splits them;
        # the ranks' logits are gathered along the vocabulary (every rank gets them all).
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype),
                                       requires_grad=False)
            if tp.size > 1:
                self.weight.weight_loader = partial(  # type: ignore[attr-defined]
                    _load_vocab_rows, vocab_size=vocab_size, start=self.vocab_start,
                    rows=self.rows_per_rank)

        self.gemv_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """Keep a bfloat16 copy for decode-sized batches where it is exact (see cpu_gemv)."""
        self.gemv_weight = bf16_gemv_weight(self.weight.data)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, hidden]`` -> float32 logits ``[n, vocab]``."""
        if self.gemv_weight is not None:
            logits = small_batch_linear(hidden, self.weight, self.gemv_weight,
                                        bf16_gemm=getattr(self, "bf16_gemm", False))
        else:
            logits = F.linear(hidden, self.weight).float()
        if self._tp.size == 1:
            return logits
        return self._tp.all_gather(logits, dim=1)[:, :self.vocab_size]
