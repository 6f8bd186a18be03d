"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

The cache holds, per token, one entry of ``kv_lora_rank + qk_rope_head_dim``
values: the normalised latent ``c`` and the rotated shared key part
``k_pe`` (:meth:`MLAAttention.kv_cache_spec`: one tensor, one head), instead
of full per-head K and V. Two ways to attend over it, which agree (tested):

- **expand** (the reference, used for prefill): up-project each cached
  latent with ``kv_b_proj`` to per-head ``k_nope`` and ``v``, append
  ``k_pe``, and run ordinary attention.
- **absorbed** (decode): fold ``kv_b_proj``'s key half into the query
  (``q_lat = q_nope W_UK``) and its value half into the output
  (``o = (sum_t p_t c_t) W_UV^T``), so attention runs directly on the cached
  latents as single-KV-head attention and nothing is expanded per token.

DeepSeek rotates ``q_pe``/``k_pe`` as interleaved pairs; the rope dims are
de-interleaved first and rotated as neox halves, which permutes ``q_pe`` and
``k_pe`` alike and so leaves every score unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from inference_engine.builtin.attention.common import (
    attend_sequence,
    causal_mask,
    gather_blocks,
    gather_context,
)
from inference_engine.distributed.parallel_state import parallel_state
from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.linear import ColumnLinear, ReplicatedLinear, RowLinear
from inference_engine.layers.norm import RMSNorm
from inference_engine.layers.rotary import RotaryTable, rope_parameters

__all__ = ["MLAAttention", "mla_softmax_scale"]


def mla_softmax_scale(cfg: Any) -> float:
    """``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim) ** 2`` when set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    mscale_all = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all:
        factor = float(params["factor"])
        m = 1.0 if factor <= 1 else 0.1 * mscale_all * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """DeepSeek-V2 attention: low-rank q (optional), compressed latent KV, paged latent cache.

    Module names follow transformers (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/
    ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).

    Args:
        ctx: the model context.
        prefix: dotted module name (``model.layers.0.self_attn``).
    """

    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.prefix = prefix
        # Under tensor parallelism each rank runs num_heads / tp heads: q and kv_b are split
        # by heads (column), o_proj by its input (row); the latent cache is every head's,
        # so each rank keeps the whole latent (as vLLM).
        total_heads = cfg.num_attention_heads
        self.num_heads = total_heads // max(1, parallel_state().tp.size)
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        hidden = cfg.hidden_size
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnLinear(ctx, hidden, total_heads * self.qk_dim,
                                       f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(ctx, hidden, self.q_lora_rank, f"{prefix}.q_a_proj",
                                             bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, ctx.dtype)
            self.q_b_proj = ColumnLinear(ctx, self.q_lora_rank, total_heads * self.qk_dim,
                                         f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(ctx, hidden, self.rank + self.rope_dim,
                                                   f"{prefix}.kv_a_proj_with_mqa", bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6, ctx.dtype)
        self.kv_b_proj = ColumnLinear(ctx, self.rank,
                                      total_heads * (self.nope_dim + self.v_dim),
                                      f"{prefix}.kv_b_proj")
        self.o_proj = RowLinear(ctx, total_heads * self.v_dim, hidden, f"{prefix}.o_proj",
                                bias=bias)
        self.scale = mla_softmax_scale(cfg)
        self.dtype = ctx.dtype
        # Interleaved rope pairs -> neox halves.
        self.register_buffer("rope_perm", torch.cat((torch.arange(0, self.rope_dim, 2),
                                                     torch.arange(1, self.rope_dim, 2))),
                             persistent=False)
        # "absorbed" or "expand": how decodes attend (prefill always expands).
        self.decode_path = "absorbed"
        # [num_blocks, block_size, 1, rank + rope_dim] view, bound by the runner.
        self.kv_cache: tuple[torch.Tensor] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """One tensor, one head: the latent and the rotated rope key of each token."""
        return KVCacheSpec(num_tensors=1, num_heads=1, head_dim=self.rank + self.rope_dim,
                           dtype=self.dtype)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, nope, rank]`` and ``W_UV [H, v, rank]`` (views of ``kv_b_proj``)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, hidden: torch.Tensor, rope: RotaryTable,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden [T, hidden]`` -> ``[T, hidden]``."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no KV cache bound; the model runner sets "
                               f"MLAAttention.kv_cache after allocating the pool")
        t, h = hidden.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, h, self.qk_dim)
        q_nope = q[..., :self.nope_dim]
        q_pe = rope.rotate(q[..., self.nope_dim:][..., self.rope_perm])
        kv = self.kv_a_proj_with_mqa(hidden)
        latent = self.kv_a_layernorm(kv[:, :self.rank])
        k_pe = rope.rotate(kv[:, None, self.rank:][..., self.rope_perm])
        entry = torch.cat((latent, k_pe[:, 0]), dim=-1)  # [T, rank + rope]
        (cache,) = self.kv_cache
        cache[metadata.slot_blocks, metadata.slot_offsets, 0] = entry.to(cache.dtype)
        out = torch.empty(t, h, self.v_dim, dtype=hidden.dtype, device=hidden.device)
        n = metadata.num_decodes
        if n:
            path = self._decode_absorbed if self.decode_path == "absorbed" else self._decode_expand
            out[:n] = path(q_nope[:n], q_pe[:n], cache, metadata)
        starts = metadata.query_start_loc.tolist()
        for i in range(n, metadata.num_seqs):
            start, end = starts[i], starts[i + 1]
            out[start:end] = self._attend_expanded(q_nope[start:end], q_pe[start:end], cache,
                                                   metadata, i)
        return self.o_proj(out.view(t, h * self.v_dim))

    def _attend_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         metadata: AttentionMetadata, seq: int) -> torch.Tensor:
        """The reference: per-head K/V expanded from one sequence's cached latents."""
        seq_len = metadata.seq_lens_list[seq]
        ctx = gather_context(cache, metadata.block_tables[seq], seq_len, metadata.block_size)
        ctx = ctx[:, 0].to(q_nope.dtype)  # [L, rank + rope]
        kv = self.kv_b_proj(ctx[:, :self.rank]).view(seq_len, self.num_heads, -1)
        k = torch.cat((kv[..., :self.nope_dim],
                       ctx[:, None, self.rank:].expand(-1, self.num_heads, -1)), dim=-1)
        v = kv[..., self.nope_dim:]
        q = torch.cat((q_nope, q_pe), dim=-1)
        mask = causal_mask(q.shape[0], seq_len, q.device)
        return attend_sequence(q, k, v, self.scale, mask)

    def _decode_expand(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                       metadata: AttentionMetadata) -> torch.Tensor:
        return torch.cat([self._attend_expanded(q_nope[i:i + 1], q_pe[i:i + 1], cache,
                                                metadata, i) for i in range(q_nope.shape[0])])

    def _decode_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         metadata: AttentionMetadata) -> torch.Tensor:
        """One query per sequence, attending the latents directly (``[n, H, v_dim]``)."""
        n, bs = q_nope.shape[0], metadata.block_size
        w_uk, w_uv = self._kv_b()
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        q = torch.cat((q_lat, q_pe), dim=-1).unsqueeze(2)  # [n, H, 1, rank + rope]
        max_len = metadata.max_decode_seq_len or max(metadata.seq_lens_list[:n])
        num_blocks = -(-max_len // bs)
        flat = metadata.block_tables[:n, :num_blocks].reshape(-1)
        entries = gather_blocks(cache, flat, "mla").view(n, 1, num_blocks * bs, -1)
        valid = (torch.arange(num_blocks * bs, device=q.device)[None, :]
                 < metadata.seq_lens[:n, None])  # [n, num_blocks * bs]
        # NOTE: slots past a sequence's end were never written (a reused or unfilled
        # block holds anything, NaN included): zero them, as a masked score's weight
        # of 0 times a NaN value would still be NaN.
        entries = entries.to(q.dtype).masked_fill(~valid[:, None, :, None], 0.0)[:, 0]
        # One latent "head" shared by every query head: plain batched matmuls over it
        # ([n, H, L] scores, softmax in float32), where SDPA's GQA path would expand the
        # latents per head (H x the context; 1.2 GB a layer for 128 heads at 8k tokens).
        scores = torch.matmul(q[:, :, 0], entries.transpose(1, 2)).float().mul_(self.scale)
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o_lat = torch.matmul(probs, entries[..., :self.rank])  # [n, H, rank]
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, rank={self.rank}, nope={self.nope_dim}, "
                f"rope={self.rope_dim}, v={self.v_dim}, decode={self.decode_path}")
