"""The MiniMax Sparse Attention (MSA) block indexer and its paged key cache.

MiniMax-M3's sparse layers select whole **blocks** of ``index_block_size`` keys
per query rather than single positions (DeepSeek's DSA,
:mod:`~inference_engine.layers.dsa_indexer`). Per token the indexer keeps one
small key (``index_head_dim`` values: a Gemma-RMSNorm-ed ``k_proj``, its first
``rot_dim`` values rotated) in the paged pool; like the DSA indexer it is a
cache-holding layer of its own (:meth:`MSAIndexer.kv_cache_spec`), so the pool
gives it a slice of every block with the same block ids as the attention's K/V.

Each query ``t`` at position ``p`` and indexer head ``h`` (one per KV head) scores::

    score[h, s] = q[t, h] . k[s]                    for s <= p (no scale, no ReLU)
    block[h, b] = max over s in block b of score[h, s]

its ``index_local_blocks`` own blocks (``p // B``, ``p // B - 1``, ...) are kept
whatever they score, and the ``index_topk_blocks`` best blocks in all (local ones
included; a block with no visible key is never kept) are what the attention of
that KV head's query heads reads
(:mod:`~inference_engine.layers.block_sparse_attention`). The top-k itself is
:func:`~inference_engine.layers.sparse_topk.topk_positions` over block scores,
so the Triton kernel is shared with DSA. Blocks are anchored to absolute
positions (block ``b`` is positions ``b*B .. b*B + B - 1``), as transformers does.

**FP8 indexer** (``config.indexer_dtype = "fp8"``, or a float8 ``--kv-cache-dtype``): the
DSA indexer's format, shared: each cached key is float8 e4m3 codes plus one float32 scale
per token (``index_head_dim + 4`` bytes), and each query head is quantised the same way
before scoring.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.builtin.attention.common import gather_context
from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.dsa_indexer import (
    _pack_fp8,
    _unpack_fp8,
    _wants_fp8,
    dequantize_fp8_rows,
    quantize_fp8_rows,
)
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import ReplicatedLinear
from inference_engine.layers.rotary import RotaryTable
from inference_engine.layers.sparse_topk import topk_positions

__all__ = ["MSAIndexer", "OffsetRMSNorm", "block_scores", "select_blocks"]


class OffsetRMSNorm(nn.Module):
    """Gemma-style RMSNorm: ``normalise(x) * (1 + weight)`` in float32, then cast back,
    as transformers' Gemma / MiniMax-M3 norms round (the stored weight is the offset).

    With ``residual`` the sum ``x + residual`` is normalised and returned too, as
    ``(normed, x + residual)`` (the decoder layers' fused residual convention).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (out * (1.0 + self.weight.float())).to(x.dtype)
        return (out, x) if residual is not None else out

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset=1"


def block_scores(q: torch.Tensor, keys: torch.Tensor, q_positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Max-pooled causal block scores.

    Args:
        q: ``[n, H, D]`` float32 indexer queries.
        keys: ``[S, D]`` (shared by every query) or ``[n, S, D]`` (one context per query)
            float32 cached keys; entries past a query's position are ignored.
        q_positions: ``[n]`` each query's position.
        block_size: keys per block.

    Returns:
        ``[n, H, ceil(S / block_size)]`` float32, ``-inf`` for blocks with no visible key.
    """
    if keys.dim() == 2:
        scores = torch.einsum("nhd,sd->nhs", q, keys)
    else:
        scores = torch.einsum("nhd,nsd->nhs", q, keys)
    n, h, s = scores.shape
    num_blocks = -(-s // block_size)
    future = torch.arange(s, device=q.device)[None, :] > q_positions[:, None]  # [n, S]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    pad = num_blocks * block_size - s
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return scores.view(n, h, num_blocks, block_size).amax(dim=-1)


def select_blocks(scores: torch.Tensor, q_positions: torch.Tensor, block_size: int,
                  topk_blocks: int, local_blocks: int, impl: str = "torch") -> torch.Tensor:
    """Each query head's kept blocks: its local blocks, then the best others.

    Args:
        scores: ``[n, H, num_blocks]`` from :func:`block_scores`.
        q_positions: ``[n]`` each query's position.

    Returns:
        ``[n, H, topk_blocks]`` int64 block ids, ascending, ``-1`` padded.
    """
    n, h, num_blocks = scores.shape
    if local_blocks > 0 and num_blocks > 0:
        own = torch.div(q_positions, block_size, rounding_mode="floor")
        local = (own[:, None] - torch.arange(local_blocks, device=scores.device)).clamp(min=0)
        local = local.clamp(max=num_blocks - 1)
        scores = scores.scatter(-1, local[:, None, :].expand(n, h, -1), float("inf"))
    picked = topk_positions(scores.reshape(n * h, num_blocks), topk_blocks, impl)
    return picked.view(n, h, topk_blocks)


class MSAIndexer(nn.Module):
    """Caches one key per token and returns each query's kept blocks per KV head.

    Module names follow transformers (``q_proj``, ``k_proj``, ``q_norm``, ``k_norm``
    under ``self_attn.indexer``).

    Args:
        ctx: the model context (``index_n_heads``, ``index_head_dim``,
            ``index_block_size``, ``index_topk_blocks``, ``index_local_blocks``).
        prefix: dotted module name (``model.layers.1.self_attn.indexer``).
        rot_dim: rotated leading dims (the model's rotary width).

    Raises:
        ValueError: for an ``index_head_dim`` narrower than the rotary width.
    """

    def __init__(self, ctx: ModelContext, prefix: str, rot_dim: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.prefix = prefix
        self.num_heads = h = cfg.index_n_heads
        self.head_dim = d = cfg.index_head_dim
        self.block_size = cfg.index_block_size
        self.topk_blocks = cfg.index_topk_blocks
        self.local_blocks = cfg.index_local_blocks
        if d < rot_dim:
            raise ValueError(f"{prefix}: index_head_dim ({d}) narrower than the rotary width "
                             f"({rot_dim}) is not supported")
        self.rot_dim = rot_dim
        self.q_proj = ReplicatedLinear(ctx, cfg.hidden_size, h * d, f"{prefix}.q_proj")
        self.k_proj = ReplicatedLinear(ctx, cfg.hidden_size, d, f"{prefix}.k_proj")
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, ctx.dtype)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, ctx.dtype)
        self.dtype = ctx.dtype
        # Whether keys are cached (and queries scored) as float8 e4m3 with per-row scales.
        self.fp8 = _wants_fp8(ctx)
        self.topk_impl = choose_fused_op(getattr(ctx, "device", None))
        # [num_blocks, block_size, 1, index_head_dim] view, bound by the runner.
        self.kv_cache: tuple[torch.Tensor] | None = None

    @property
    def dense_context(self) -> int:
        """The longest context in which every query keeps every block it sees."""
        return self.topk_blocks * self.block_size

    def kv_cache_spec(self) -> KVCacheSpec:
        """One key of ``index_head_dim`` values per token (FP8: its codes and scale, as bytes)."""
        if self.fp8:
            return KVCacheSpec(num_tensors=1, num_heads=1, head_dim=self.head_dim + 4,
                               dtype=torch.uint8)
        return KVCacheSpec(num_tensors=1, num_heads=1, head_dim=self.head_dim, dtype=self.dtype)

    def cached_keys(self, raw: torch.Tensor) -> torch.Tensor:
        """Cache entries ``[..., entry]`` -> float32 keys ``[..., index_head_dim]``."""
        return _unpack_fp8(raw, self.head_dim) if self.fp8 else raw.float()

    def _rotate(self, rope: RotaryTable, x: torch.Tensor) -> torch.Tensor:
        r = self.rot_dim
        return torch.cat((rope.rotate(x[..., :r]), x[..., r:]), dim=-1)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: RotaryTable,
                metadata: AttentionMetadata) -> torch.Tensor | None:
        """Cache this step's keys; return each query's kept blocks.

        Args:
            hidden: ``[T, hidden]`` the attention's input.
            positions: ``[T]`` each token's position.

        Returns:
            ``[T, index_n_heads, index_topk_blocks]`` int64 block ids (ascending, ``-1``
            padded), or None when no context in the step is longer than
            :attr:`dense_context` (every query keeps all it sees).
        """
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no indexer cache bound; the model runner sets "
                               f"MSAIndexer.kv_cache after allocating the pool")
        t = hidden.shape[0]
        key = self._rotate(rope, self.k_norm(self.k_proj(hidden).view(t, 1, self.head_dim)))
        (cache,) = self.kv_cache
        cache[metadata.slot_blocks, metadata.slot_offsets] = (
            _pack_fp8(key) if self.fp8 else key.to(cache.dtype))
        if max(metadata.seq_lens_list, default=0) <= self.dense_context:
            return None
        q = self._rotate(rope, self.q_norm(self.q_proj(hidden).view(t, self.num_heads,
                                                                    self.head_dim))).float()
        if self.fp8:
            q = dequantize_fp8_rows(*quantize_fp8_rows(q))
        out = torch.empty(t, self.num_heads, self.topk_blocks, dtype=torch.int64,
                          device=hidden.device)
        n = metadata.num_decodes
        if n:
            out[:n] = self._decode_selection(q[:n], cache, metadata)
        starts = metadata.query_start_loc.tolist()
        for i in range(n, metadata.num_seqs):
            start, end = starts[i], starts[i + 1]
            keys = gather_context(cache, metadata.block_tables[i], metadata.seq_lens_list[i],
                                  metadata.block_size)[:, 0]
            keys = self.cached_keys(keys)
            scores = block_scores(q[start:end], keys, positions[start:end], self.block_size)
            out[start:end] = select_blocks(scores, positions[start:end], self.block_size,
                                           self.topk_blocks, self.local_blocks, self.topk_impl)
        return out

    def _decode_selection(self, q: torch.Tensor, cache: torch.Tensor,
                          metadata: AttentionMetadata) -> torch.Tensor:
        """``n`` decodes (the last position of each sequence) in one batched gather."""
        n, bs = q.shape[0], metadata.block_size
        width = max(metadata.seq_lens_list[:n])
        tables = metadata.block_tables[:n, :-(-width // bs)]
        keys = self.cached_keys(cache[tables].reshape(n, -1, cache.shape[-1])[:, :width])
        q_positions = metadata.seq_lens[:n] - 1
        # NOTE: slots past a context's end were never written (anything, NaN included).
        valid = torch.arange(width, device=q.device)[None, :] <= q_positions[:, None]
        keys = keys.masked_fill(~valid[..., None], 0.0)
        scores = block_scores(q, keys, q_positions, self.block_size)
        return select_blocks(scores, q_positions, self.block_size, self.topk_blocks,
                             self.local_blocks, self.topk_impl)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, block={self.block_size}, "
                f"topk_blocks={self.topk_blocks}, local_blocks={self.local_blocks}, "
                f"cache={'fp8' if self.fp8 else self.dtype}")
