"""The DeepSeek Sparse Attention (DSA) "lightning indexer" and its paged key cache.

Per token the indexer keeps one small key (``index_head_dim`` values: a
LayerNorm-ed ``wk`` projection, its first ``qk_rope_head_dim`` values rotated)
in the paged pool. It is a cache-holding layer of its own
(:meth:`LightningIndexer.kv_cache_spec`), so the pool gives it a slice of every
block beside its attention layer's MLA latents: same block ids, written at
prefill and decode, kept by the prefix cache and freed with the block like any
K/V.

Each query scores every visible cached position::

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) * (H ** -0.5 * D ** -0.5)

with ``q`` from the attention's q-LoRA latent (``wq_b``) and ``w`` from the
hidden state (``weights_proj``); the top ``index_topk`` positions
(:func:`~inference_engine.layers.sparse_topk.topk_positions`) are what the
sparse MLA attends. DeepSeek-V3.2 rotates the rope part as neox halves,
GLM-5 as interleaved pairs (de-interleaved here: the same permutation of q and
k leaves every score unchanged).

**FP8 indexer** (``config.indexer_dtype = "fp8"``, or a float8 ``--kv-cache-dtype``):
as DeepSeek's ``fp8_index``, each cached key is stored as float8 e4m3 with one
float32 scale per token (``amax / 448``), packed as ``index_head_dim + 4`` bytes
per token, and each query head is quantised the same way; the scores are the
formula above on the dequantised values (both scales are positive, so they
factor out of the ReLU). The cache then takes about a quarter of the float32
bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.builtin.attention.common import gather_context
from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import ReplicatedLinear
from inference_engine.layers.rotary import RotaryTable
from inference_engine.layers.sparse_topk import topk_positions

__all__ = ["FP8_MAX", "LightningIndexer", "dequantize_fp8_rows", "index_scores",
           "quantize_fp8_rows"]

# Largest finite float8 e4m3 value: a row's amax maps here.
FP8_MAX = 448.0


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3: ``(codes [..., D] float8_e4m3fn, scale [..., 1] float32)`` with
    ``x ~= codes * scale`` and ``scale = amax(|row|) / 448`` (1 for an all-zero row)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` in float32."""
    return codes.float() * scale


def _pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """``[T, D]`` -> ``[T, D + 4]`` uint8: the e4m3 codes then the float32 scale's bytes."""
    codes, scale = quantize_fp8_rows(x)
    return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1)


def _unpack_fp8(raw: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`_pack_fp8`, dequantised to float32 ``[T, D]``."""
    codes = raw[..., :dim].contiguous().view(torch.float8_e4m3fn)
    scale = raw[..., dim:].contiguous().view(torch.float32)
    return dequantize_fp8_rows(codes, scale)


def _wants_fp8(ctx: ModelContext) -> bool:
    """``config.indexer_dtype``: "fp8"; "model" (the model's dtype); "auto" (the default:
    fp8 when the KV cache dtype is a float8, else the model's dtype)."""
    option = getattr(ctx.hf_config, "indexer_dtype", None) or "auto"
    if option not in ("auto", "fp8", "model"):
        raise ValueError(f"indexer_dtype must be 'auto', 'fp8' or 'model', got {option!r}")
    kv = getattr(ctx, "kv_cache_dtype", None)
    return option == "fp8" or (option == "auto" and kv is not None and kv.itemsize == 1
                               and kv.is_floating_point)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 first_position: int) -> torch.Tensor:
    """One sequence's indexer scores, causal.

    Args:
        q: ``[q_len, H, D]`` float32 indexer queries (already scaled).
        weights: ``[q_len, H]`` float32 per-head weights (already scaled).
        keys: ``[seq_len, D]`` float32 cached indexer keys.
        first_position: the position of the first query.

    Returns:
        ``[q_len, seq_len]`` float32, ``-inf`` at positions after each query's own.
    """
    scores = torch.einsum("qhd,sd->qhs", q, keys).relu_()
    scores = torch.einsum("qhs,qh->qs", scores, weights)
    q_pos = torch.arange(first_position, first_position + q.shape[0], device=q.device)
    future = torch.arange(keys.shape[0], device=q.device)[None, :] > q_pos[:, None]
    return scores.masked_fill_(future, float("-inf"))


class LightningIndexer(nn.Module):
    """Scores cached positions for each query and keeps the top ``index_topk``.

    Module names follow transformers (``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj`` under ``self_attn.indexer``).

    Args:
        ctx: the model context.
        prefix: dotted module name (``model.layers.0.self_attn.indexer``).
        rope_interleaved: whether the checkpoint rotates interleaved pairs (GLM-5)
            rather than neox halves (DeepSeek-V3.2).
    """

    def __init__(self, ctx: ModelContext, prefix: str, rope_interleaved: bool) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.prefix = prefix
        self.num_heads = h = cfg.index_n_heads
        self.head_dim = d = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = ReplicatedLinear(ctx, cfg.q_lora_rank, h * d, f"{prefix}.wq_b")
        self.wk = ReplicatedLinear(ctx, cfg.hidden_size, d, f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(d, eps=1e-6, dtype=ctx.dtype)
        self.weights_proj = ReplicatedLinear(ctx, cfg.hidden_size, h, f"{prefix}.weights_proj")
        self.dtype = ctx.dtype
        # Whether keys are cached (and queries scored) as float8 e4m3 with per-row scales.
        self.fp8 = _wants_fp8(ctx)
        perm = (torch.cat((torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)))
                if rope_interleaved else torch.arange(self.rope_dim))
        self.register_buffer("rope_perm", perm, persistent=False)
        self.topk_impl = choose_fused_op(getattr(ctx, "device", None))
        # [num_blocks, block_size, 1, index_head_dim] view, bound by the runner.
        self.kv_cache: tuple[torch.Tensor] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """One key of ``index_head_dim`` values per token (FP8: its codes and scale, as bytes)."""
        if self.fp8:
            return KVCacheSpec(num_tensors=1, num_heads=1, head_dim=self.head_dim + 4,
                               dtype=torch.uint8)
        return KVCacheSpec(num_tensors=1, num_heads=1, head_dim=self.head_dim, dtype=self.dtype)

    def cached_keys(self, raw: torch.Tensor) -> torch.Tensor:
        """Cache entries ``[L, entry]`` -> float32 keys ``[L, index_head_dim]``."""
        return _unpack_fp8(raw, self.head_dim) if self.fp8 else raw.float()

    def _rotate(self, rope: RotaryTable, x: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, D]`` with its first ``rope_dim`` values rotated."""
        r = self.rope_dim
        return torch.cat((rope.rotate(x[..., :r][..., self.rope_perm]), x[..., r:]), dim=-1)

    def forward(self, hidden: torch.Tensor, q_latent: torch.Tensor, rope: RotaryTable,
                metadata: AttentionMetadata) -> torch.Tensor | None:
        """Cache this step's keys; return each query's selected positions.

        Args:
            hidden: ``[T, hidden]`` the attention's input.
            q_latent: ``[T, q_lora_rank]`` the attention's normed q-LoRA latent.

        Returns:
            ``[T, index_topk]`` int64 positions (ascending, ``-1`` padded), or None when no
            context in the step is longer than ``index_topk`` (every query keeps all it
            sees: dense attention is the same and cheaper).
        """
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no indexer cache bound; the model runner sets "
                               f"LightningIndexer.kv_cache after allocating the pool")
        t = hidden.shape[0]
        key = self._rotate(rope, self.k_norm(self.wk(hidden))[:, None])[:, 0]
        (cache,) = self.kv_cache
        cache[metadata.slot_blocks, metadata.slot_offsets, 0] = (
            _pack_fp8(key) if self.fp8 else key.to(cache.dtype))
        if max(metadata.seq_lens_list, default=0) <= self.topk:
            return None
        q = self._rotate(rope, self.wq_b(q_latent).view(t, self.num_heads, self.head_dim))
        if self.fp8:
            q = dequantize_fp8_rows(*quantize_fp8_rows(q))
        q = q.float() * self.head_dim ** -0.5
        weights = self.weights_proj(hidden).float() * self.num_heads ** -0.5
        width = max(metadata.seq_lens_list)
        scores = torch.full((t, width), float("-inf"), dtype=torch.float32, device=hidden.device)
        n = metadata.num_decodes
        if n:
            scores[:n] = self._decode_scores(q[:n], weights[:n], cache, metadata, width)
        starts = metadata.query_start_loc.tolist()
        for i in range(n, metadata.num_seqs):
            seq_len = metadata.seq_lens_list[i]
            start, end = starts[i], starts[i + 1]
            keys = gather_context(cache, metadata.block_tables[i], seq_len, metadata.block_size)
            scores[start:end, :seq_len] = index_scores(
                q[start:end], weights[start:end], self.cached_keys(keys[:, 0]),
                seq_len - (end - start))
        return topk_positions(scores, self.topk, self.topk_impl)

    def _decode_scores(self, q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                       metadata: AttentionMetadata, width: int) -> torch.Tensor:
        """Scores of ``n`` decodes (one query each, the last position of its sequence) in
        one batched gather and two einsums: ``[n, width]``, ``-inf`` past each context."""
        n, bs = q.shape[0], metadata.block_size
        num_blocks = -(-width // bs)
        tables = metadata.block_tables[:n, :num_blocks]
        keys = self.cached_keys(cache[tables].reshape(n, num_blocks * bs, -1)[:, :width])
        valid = torch.arange(width, device=q.device)[None, :] < metadata.seq_lens[:n, None]
        # NOTE: slots past a context's end were never written (anything, NaN included).
        keys = keys.masked_fill(~valid[..., None], 0.0)
        scores = torch.einsum("nhd,nsd->nhs", q, keys).relu_()
        scores = torch.einsum("nhs,nh->ns", scores, weights)
        return scores.masked_fill_(~valid, float("-inf"))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, topk={self.topk}, "
                f"cache={'fp8' if self.fp8 else self.dtype}")
