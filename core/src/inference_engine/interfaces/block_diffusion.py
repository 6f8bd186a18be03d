"""What a block-diffusion model plugin provides beyond a causal LM (DiffusionGemma).

The causal ``forward`` is the *encoder*: it runs ordinary prefill chunks over the
prompt and each committed block and is the only writer of the KV cache. ``denoise``
is the weight-shared *decoder*: one pass over a canvas of ``canvas_length`` tokens
per request, attending the cached prefix read-only plus the canvas non-causally.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from inference_engine.interfaces.model import CausalLM

if TYPE_CHECKING:
    from inference_engine.interfaces.attention import AttentionMetadata

__all__ = ["BlockDiffusionLM"]


class BlockDiffusionLM(CausalLM):
    """A causal encoder plus a denoiser over fixed-size canvases (blocks)."""

    # Tokens per block (``config.canvas_length``); a denoise pass computes this many queries.
    canvas_length: int
    # Token id of a "pad" start canvas (``start_canvas="pad"``).
    pad_token_id: int

    @abstractmethod
    def denoise(self, canvas_ids: torch.Tensor, soft_embeddings: torch.Tensor | None,
                positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Float32 logits ``[B, C, vocab]`` of one decoder pass over ``B`` canvases.

        Args:
            canvas_ids: ``[B, C]`` current canvas token ids.
            soft_embeddings: ``[B, C, hidden]`` self-conditioning input from the previous
                step (:meth:`soft_embeddings`), or None on a block's first step (zeros).
            positions: ``[B * C]`` positions ``[L_i, L_i + C)`` of each canvas.
            metadata: the prefix layout: ``seq_lens_list`` the cached prefix lengths,
                ``block_tables`` their blocks, ``query_start_loc`` the canvases' offsets.
                Nothing is written to the cache.
        """

    @abstractmethod
    def soft_embeddings(self, processed_logits: torch.Tensor) -> torch.Tensor:
        """``[B, C, vocab]`` temperature-scaled logits -> ``[B, C, hidden]`` probability-
        weighted embeddings, the next step's self-conditioning input (kept instead of the
        logits: C x hidden rather than C x vocab per request)."""
