"""Several greedy decode steps of one sequence in one C++ call (multi-step decoding).

After the whole-step C++ decode (:mod:`~inference_engine.layers.cpu_decode_step`) a
batch-1 step still spends its time in Python between forwards: scheduling, input
preparation, the LM head and argmax dispatch, output processing (figures in
``docs/benchmarks.md``, "CPU single stream"). For a greedy sequence nothing in that
Python changes the next token, so the bound step runs a *window* of K steps in one call
(vLLM's former multi-step scheduling): the layers, the final norm, the LM head, argmax,
then the picked token's embedding, position and cache slot, K times, stopping early at a
stop id. Every kernel is the one the one-step path calls, on the same inputs, so the
tokens are the one-step path's, bit for bit (tested).

Chosen once, when the cache is bound (``DecoderForCausalLM.kv_cache_bound``):
:func:`build_greedy_window` returns None, with the reason logged at debug level, unless
the model is exactly the shared decoder with the C++ decode step bound, the final RMSNorm
on the CPU kernel and an LM head the window can multiply by (its packed bf16 copy, or a
head's product as a C function: ``cpu_linear_entry(input_size)``, as the GGUF q8 head
gives). A float32 embedding table is read in place; another embedding (GGML rows) is read
once into one, every row as the module computes it, up to ``MAX_EMBEDDING_TABLE_BYTES``.
The engine decides per batch whether a window applies (``engine/multi_step.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from inference_engine.layers.cpu_fused import fused_kernels
from inference_engine.layers.cpu_gemv import is_packed

__all__ = ["CpuGreedyWindow", "build_greedy_window", "greedy_window_blocker"]

logger = logging.getLogger(__name__)


class CpuGreedyWindow:
    """The bound C++ greedy window of one sequence."""

    def __init__(self, step: Any, vocab_size: int) -> None:
        self._step = step
        self.vocab_size = vocab_size
        self._table = torch.empty(0, dtype=torch.int64)

    def run(self, token: int, position: int, block_ids: list[int], stop_ids: torch.Tensor,
            num_steps: int) -> list[int]:
        """Up to ``num_steps`` greedy tokens after ``token`` (the last known token, at
        ``position``, not in the cache yet), stopping after one in ``stop_ids`` (int64).

        ``block_ids`` must hold a cache slot for positions ``position ..
        position + num_steps - 1``; the K/V of every returned token but the last is written.
        """
        if len(block_ids) > self._table.numel():
            self._table = torch.empty(max(len(block_ids), 2 * self._table.numel()),
                                      dtype=torch.int64)
        table = self._table[: len(block_ids)]
        table.numpy()[:] = block_ids
        out = torch.empty(num_steps, dtype=torch.int64)
        with torch.inference_mode():
            n = self._step.greedy_window(token, position, table, stop_ids, out)
        return out[:n].tolist()


# A non-table embedding (GGML rows) is read once into a float32 table for the window up to
# this size; larger vocabularies keep one step per token.
MAX_EMBEDDING_TABLE_BYTES = 256 << 20


def greedy_window_blocker(lm: torch.nn.Module) -> str | None:
    """Why a greedy window cannot run ``lm`` (a ``DecoderForCausalLM``), or None."""
    reason = _structure_blocker(lm)
    if reason is None:
        head = _head_spec(lm)
        reason = head if isinstance(head, str) else None
    return reason


def _structure_blocker(lm: torch.nn.Module) -> str | None:
    from inference_engine.layers.embedding import VocabEmbedding

    overrides = getattr(lm, "override_blocker", None)
    if overrides is None:
        return f"{type(lm).__name__} is not the shared decoder"
    model = lm.model
    if model.decode_step is None:
        return "the layers have no C++ decode step"
    reason = overrides()
    if reason is not None:
        return reason
    embed = model.embed_tokens
    vocab = lm.ctx.hf_config.vocab_size
    if type(embed) is VocabEmbedding:
        if embed._tp.size != 1:
            return "the embedding is split over ranks"
        if embed.weight.dtype != torch.float32 or not embed.weight.is_contiguous():
            return "the embedding table is not contiguous float32"
    elif vocab * model.norm.hidden_size * 4 > MAX_EMBEDDING_TABLE_BYTES:
        return (f"the {type(embed).__name__} embedding would take more than "
                f"{MAX_EMBEDDING_TABLE_BYTES >> 20} MiB as a float32 table")
    norm = model.norm
    if norm.fused_op != "cpu" or norm.weight.dtype != torch.float32:
        return "the final norm does not use the CPU kernel on float32 weights"
    if fused_kernels() is None:
        return "the CPU fused kernels are not built"
    return None


def _head_spec(lm: torch.nn.Module) -> torch.Tensor | tuple[int, int, Any] | str:
    """What the window multiplies by for the logits: the LM head's packed bf16 copy, the
    product a head provides as a C function (``cpu_linear_entry(input_size)``, as the
    GGUF q8 head does), or why neither exists."""
    from inference_engine.layers.embedding import LMHead

    head = lm.lm_head
    if type(head) is LMHead:
        if head._tp.size != 1 or head.rows_per_rank != head.vocab_size:
            return "the LM head is split over ranks"
        if head.gemv_weight is None or not is_packed(head.gemv_weight):
            return "the LM head has no packed bf16 copy"
        return head.gemv_weight
    provide = getattr(head, "cpu_linear_entry", None)
    entry = provide(lm.model.norm.hidden_size) if provide is not None else None
    if entry is None:
        return f"the LM head ({type(head).__name__}) gives the window no product"
    return (entry.function, entry.context, entry.owner)


def _embedding_table(lm: torch.nn.Module) -> torch.Tensor | str:
    """The float32 ``[vocab, hidden]`` rows the window embeds from: the table itself, or
    (another embedding, such as GGML rows) every row as the module computes it."""
    from inference_engine.layers.embedding import VocabEmbedding

    embed = lm.model.embed_tokens
    if type(embed) is VocabEmbedding:
        return embed.weight.data
    with torch.inference_mode():
        table = lm.embed(torch.arange(lm.ctx.hf_config.vocab_size))
    if table.dtype != torch.float32:
        return f"the embedding computes {table.dtype}, not float32"
    return table.contiguous()


def build_greedy_window(lm: torch.nn.Module) -> CpuGreedyWindow | None:
    """The greedy window bound to ``lm``'s weights and caches, or None (reason logged)."""
    reason = _structure_blocker(lm)
    head = _head_spec(lm) if reason is None else None
    if isinstance(head, str):
        reason = head
    table = _embedding_table(lm) if reason is None else None
    if isinstance(table, str):
        reason = table
    if reason is not None:
        logger.debug("no multi-step greedy window: %s", reason)
        return None
    model = lm.model
    vocab = lm.ctx.hf_config.vocab_size
    step = model.decode_step.kernel
    step.bind_greedy(table, model.norm.weight.data, float(model.norm.eps), head, None, vocab,
                     model.rotary_emb.cos_sin_cache, fused_kernels().entry_points())
    logger.debug("greedy decode windows run as one C++ call")
    return CpuGreedyWindow(step, vocab)
