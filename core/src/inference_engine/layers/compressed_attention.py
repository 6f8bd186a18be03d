"""DeepSeek-V4 attention over a sliding window plus compressed entries, and the CSA indexer.

Every V4 layer attends, with one shared K=V head and per-head sinks, to

- the last ``sliding_window`` tokens (``t - window < s <= t``), and on compressed layers
- compressed entries (:mod:`~inference_engine.layers.kv_compressor`): entry ``w`` is
  visible to query ``t`` once its window closed (``w < (t + 1) // rate``); HCA layers
  see all of those, CSA layers only the ``index_topk`` an indexer picks
  (:class:`CompressedIndexer`).

Keys and entries live in the paged pool; a decode gathers ``window + entries`` rows
per sequence (``index_topk`` entries on CSA, however long the context), a prefill
chunk gathers its sequence's window span and entries once and masks per query.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.kv_compressor import KVCompressor, paged_rows
from inference_engine.layers.linear import ReplicatedLinear
from inference_engine.layers.sparse_topk import topk_positions
from inference_engine.layers.tail_rope import TailRope

__all__ = ["SCORE_BUDGET", "CompressedIndexer", "indexer_scores", "sink_attention",
           "visible_entries"]

# Float32 score elements (queries x heads x entries) one indexer prefill tile may make (128 MiB).
SCORE_BUDGET = 1 << 25


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Single-K=V-head attention with per-head sink logits, in float32.

    Args:
        q: ``[n, H, D]``.
        keys: ``[n, S, D]`` (one key set per query) or ``[S, D]`` (shared); also the values.
        mask: ``[n, S]`` bool, True where query ``i`` may attend key ``s``.
        sinks: ``[H]`` logits added to each softmax's denominator only.
        scale: softmax scale.

    Returns:
        ``[n, H, D]`` in ``q``'s dtype (zero-free: the sink keeps the denominator positive).
    """
    qf, kf = q.float(), keys.float()
    if kf.dim() == 2:
        scores = torch.einsum("nhd,sd->nhs", qf, kf) * scale
    else:
        scores = torch.einsum("nhd,nsd->nhs", qf, kf) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = logits.softmax(dim=-1)[..., :-1]
    if kf.dim() == 2:
        out = torch.einsum("nhs,sd->nhd", probs, kf)
    else:
        out = torch.einsum("nhs,nsd->nhd", probs, kf)
    return out.to(q.dtype)


def visible_entries(q_positions: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """``[n, num_entries]`` bool: entry ``w`` closed by query position ``t`` (``w*rate +
    rate - 1 <= t``)."""
    w = torch.arange(num_entries, device=q_positions.device)
    return w[None, :] < torch.div(q_positions + 1, rate, rounding_mode="floor")[:, None]


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor,
                   softmax_scale: float) -> torch.Tensor:
    """``sum_h w[h] * relu(q[h] . k) * softmax_scale``.

    Args:
        q: ``[n, H, d]`` float32 rotated indexer queries.
        keys: ``[n, E, d]`` or ``[E, d]`` float32 compressed indexer keys.
        head_weights: ``[n, H]`` float32 per-head weights.

    Returns:
        ``[n, E]`` float32.
    """
    if keys.dim() == 2:
        scores = torch.einsum("nhd,ed->nhe", q, keys)
    else:
        scores = torch.einsum("nhd,ned->nhe", q, keys)
    return (scores.relu() * softmax_scale * head_weights[..., None]).sum(dim=1)


class CompressedIndexer(nn.Module):
    """CSA's lightning indexer over its own compressed keys (checkpoint names: ``wq_b``,
    ``weights_proj``, ``compressor.*`` under ``...attn.indexer``).

    Args:
        ctx: the model context (``index_n_heads``, ``index_head_dim``, ``index_topk``,
            ``q_lora_rank``).
        prefix: dotted module name.
        rate: the CSA compression rate.
        rope: the ``compress`` rotary (queries at their positions, keys at window starts).
    """

    def __init__(self, ctx: ModelContext, prefix: str, rate: int, rope: TailRope) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.prefix = prefix
        self.num_heads = h = cfg.index_n_heads
        self.head_dim = d = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.rate = rate
        if d < rope.rot_dim:
            raise ValueError(f"{prefix}: index_head_dim ({d}) narrower than the rotary width "
                             f"({rope.rot_dim}) is not supported")
        self.rope = rope
        self.wq_b = ReplicatedLinear(ctx, cfg.q_lora_rank, h * d, f"{prefix}.wq_b")
        self.weights_proj = ReplicatedLinear(ctx, cfg.hidden_size, h, f"{prefix}.weights_proj")
        self.compressor = KVCompressor(ctx, f"{prefix}.compressor", d, rate, True, rope)
        self.topk_impl = choose_fused_op(getattr(ctx, "device", None))

    def forward(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                rope_cs: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        """Store this step's indexer keys; return each query's kept entries.

        Args:
            hidden: ``[T, hidden]`` the attention's input.
            q_residual: ``[T, q_lora_rank]`` the normed q down-projection.
            positions: ``[T]`` each token's position.
            rope_cs: the ``compress`` ``(cos, sin)`` at ``positions``.

        Returns:
            ``[T, index_topk]`` int64 entry ids, ascending, ``-1`` padded.
        """
        self.compressor(hidden, metadata)
        t = hidden.shape[0]
        q = self.wq_b(q_residual).view(t, self.num_heads, self.head_dim)
        q = self.rope.rotate(q, *rope_cs).float()
        head_weights = self.weights_proj(hidden).float() * self.num_heads ** -0.5
        scale = self.head_dim ** -0.5
        out = torch.full((t, self.topk), -1, dtype=torch.int64, device=hidden.device)
        n = metadata.num_decodes
        if n:
            num = [s // self.rate for s in metadata.seq_lens_list[:n]]
            width = max(num)
            if width:
                idx = torch.arange(width, device=hidden.device)[None, :].expand(n, -1)
                rows = torch.arange(n, device=hidden.device)[:, None].expand(n, width)
                keys = self.compressor.entries(rows, idx, metadata.block_tables).float()
                valid = visible_entries(positions[:n], width, self.rate)
                keys = keys.masked_fill(~valid[..., None], 0.0)
                scores = indexer_scores(q[:n], keys, head_weights[:n], scale)
                scores = scores.masked_fill(~valid, float("-inf"))
                out[:n] = topk_positions(scores, self.topk, self.topk_impl)
        starts = metadata.query_start_loc.tolist()
        for i in range(n, metadata.num_seqs):
            start, end = starts[i], starts[i + 1]
            num = metadata.seq_lens_list[i] // self.rate
            if num == 0:
                continue
            idx = torch.arange(num, device=hidden.device)
            keys = self.compressor.entries(torch.full_like(idx, i), idx,
                                           metadata.block_tables).float()
            # Tiles of queries, each scoring the entries its last query has closed, so the
            # float32 [tile, heads, entries] scores stay within SCORE_BUDGET elements.
            first = metadata.seq_lens_list[i] - (end - start)
            tile = max(16, SCORE_BUDGET // (self.num_heads * num))
            for a in range(start, end, tile):
                b = min(end, a + tile)
                closed = (first + b - start) // self.rate
                if closed == 0:
                    continue
                scores = indexer_scores(q[a:b], keys[:closed], head_weights[a:b], scale)
                valid = visible_entries(positions[a:b], closed, self.rate)
                out[a:b] = topk_positions(scores.masked_fill(~valid, float("-inf")),
                                          self.topk, self.topk_impl)
        return out


def window_span(cache: torch.Tensor, block_tables: torch.Tensor, row: int, lo: int,
                hi: int) -> torch.Tensor:
    """Sequence ``row``'s cached rows at positions ``lo .. hi - 1`` -> ``[hi - lo, W]``."""
    pos = torch.arange(lo, hi, device=cache.device)
    return paged_rows(cache, block_tables, torch.full_like(pos, row), pos)
