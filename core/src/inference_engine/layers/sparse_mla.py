"""Multi-head latent attention restricted to the positions a DSA indexer selects.

DeepSeek-V3.2 and GLM-5 attend, per query, only the ``index_topk`` cached
positions their :class:`~inference_engine.layers.dsa_indexer.LightningIndexer`
scores highest. Decodes gather just those latents from the paged pool (by
block table, in place) and attend them with the absorbed weights
(:func:`sparse_latent_attention_torch`, or the Triton kernel of
:mod:`inference_engine.layers.triton_sparse_mla` on GPU platforms), so a decode
step reads ``index_topk`` entries however long the context. With the kernel,
prefill tokens take the same path; the torch path expands each prefill chunk's
sequence latents and masks everything not selected (gathering ``index_topk``
latents per prefill token would cost more memory than that). While no
context in the step is longer than ``index_topk`` every query keeps all it
sees, so the dense MLA paths run unchanged.

GLM-5's "shared" layers have no indexer: they reuse the selection of the
previous layer that has one, passed through the step's
``metadata.backend_cache`` (layers run in order within a step).
"""

from __future__ import annotations

import torch

from inference_engine.builtin.attention.common import attend_sequence, gather_context
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.dsa_indexer import LightningIndexer
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.mla import MLAAttention
from inference_engine.layers.rotary import RotaryTable

__all__ = ["SELECTION_KEY", "SparseMLAAttention", "selected_slots",
           "sparse_latent_attention_torch"]

# Where a layer with an indexer leaves the step's selection for the shared layers after it.
SELECTION_KEY = "dsa_selection"


def selected_slots(positions: torch.Tensor, block_table: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool coordinates of selected positions.

    Args:
        positions: ``[rows, k]`` int64 positions, ``-1`` for none.
        block_table: ``[rows, max_blocks]`` each row's sequence's block ids.

    Returns:
        ``(blocks, offsets)`` each ``[rows, k]`` (a ``-1`` reads position 0, to be masked).
    """
    pos = positions.clamp(min=0)
    blocks = block_table.gather(1, torch.div(pos, block_size, rounding_mode="floor"))
    return blocks, pos % block_size


def sparse_latent_attention_torch(q: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                                  block_tables: torch.Tensor, rank: int,
                                  scale: float) -> torch.Tensor:
    """The reference sparse decode: ``[n, H, rank]`` attention outputs over the selected latents.

    Single-KV-head attention as two batched matmuls (scores ``[n, H, k]``), so the
    gathered latents are never repeated per head.

    Args:
        q: ``[n, H, rank + rope]`` absorbed queries ``[q_lat | q_pe]``.
        cache: the layer's pool view ``[num_blocks, block_size, 1, rank + rope]``.
        positions: ``[n, k]`` selected positions per query, ``-1`` for none.
        block_tables: ``[n, max_blocks]`` each query's sequence's block ids.
    """
    blocks, offsets = selected_slots(positions, block_tables, cache.shape[1])
    valid = positions >= 0  # [n, k]
    entries = cache[blocks, offsets, 0].to(q.dtype)  # [n, k, rank + rope]
    # NOTE: a -1 pick reads position 0's slot; zero it so nothing non-finite leaks in.
    entries = entries.masked_fill(~valid[..., None], 0.0)
    scores = torch.bmm(q, entries.transpose(1, 2)).float() * scale  # [n, H, k]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.bmm(probs.to(q.dtype), entries[..., :rank])


def _sparse_latent_attention_triton(*args: object) -> torch.Tensor:
    from inference_engine.layers.triton_sparse_mla import sparse_latent_attention_triton

    return sparse_latent_attention_triton(*args)


class SparseMLAAttention(MLAAttention):
    """:class:`MLAAttention` over the indexer's top-k positions.

    Args:
        ctx: the model context (``q_lora_rank`` must be set: the indexer reads the q latent).
        prefix: dotted module name (``model.layers.0.self_attn``).
        has_indexer: False for a layer that reuses the previous layer's selection.
        rope_interleaved_indexer: passed to :class:`LightningIndexer`.
    """

    def __init__(self, ctx: ModelContext, prefix: str, has_indexer: bool = True,
                 rope_interleaved_indexer: bool = False) -> None:
        super().__init__(ctx, prefix)
        if self.q_lora_rank is None:
            raise ValueError(f"{prefix}: sparse (DSA) attention needs config.q_lora_rank; "
                             f"the indexer's queries come from the q latent")
        self.indexer = (LightningIndexer(ctx, f"{prefix}.indexer", rope_interleaved_indexer)
                        if has_indexer else None)
        # "triton" (GPU platforms): the sparse decode kernel; else the torch reference.
        self.sparse_decode_impl = choose_fused_op(getattr(ctx, "device", None))

    def forward(self, hidden: torch.Tensor, rope: RotaryTable,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden [T, hidden]`` -> ``[T, hidden]``."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no KV cache bound; the model runner sets "
                               f"MLAAttention.kv_cache after allocating the pool")
        t, h = hidden.shape[0], self.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_latent).view(t, h, self.qk_dim)
        q_nope = q[..., :self.nope_dim]
        q_pe = rope.rotate(q[..., self.nope_dim:][..., self.rope_perm])
        kv = self.kv_a_proj_with_mqa(hidden)
        latent = self.kv_a_layernorm(kv[:, :self.rank])
        k_pe = rope.rotate(kv[:, None, self.rank:][..., self.rope_perm])
        (cache,) = self.kv_cache
        cache[metadata.slot_blocks, metadata.slot_offsets, 0] = (
            torch.cat((latent, k_pe[:, 0]), dim=-1).to(cache.dtype))
        selected = self._selection(hidden, q_latent, rope, metadata)
        if selected is not None and self.sparse_decode_impl == "triton":
            # The kernel reads only the selected latents for every token, prefill included.
            seq_of_token = torch.repeat_interleave(
                torch.arange(metadata.num_seqs, device=hidden.device),
                torch.tensor(metadata.query_lens_list, device=hidden.device))
            out = self._attend_selected(q_nope, q_pe, cache,
                                        metadata.block_tables[seq_of_token], selected)
            return self.o_proj(out.reshape(t, h * self.v_dim))
        out = torch.empty(t, h, self.v_dim, dtype=hidden.dtype, device=hidden.device)
        n = metadata.num_decodes
        if n:
            if selected is None:
                path = (self._decode_absorbed if self.decode_path == "absorbed"
                        else self._decode_expand)
                out[:n] = path(q_nope[:n], q_pe[:n], cache, metadata)
            else:
                out[:n] = self._attend_selected(q_nope[:n], q_pe[:n], cache,
                                                metadata.block_tables[:n], selected[:n])
        starts = metadata.query_start_loc.tolist()
        for i in range(n, metadata.num_seqs):
            start, end = starts[i], starts[i + 1]
            if selected is None:
                out[start:end] = self._attend_expanded(q_nope[start:end], q_pe[start:end],
                                                       cache, metadata, i)
            else:
                out[start:end] = self._prefill_selected(q_nope[start:end], q_pe[start:end],
                                                        cache, metadata, i, selected[start:end])
        return self.o_proj(out.view(t, h * self.v_dim))

    def _selection(self, hidden: torch.Tensor, q_latent: torch.Tensor, rope: RotaryTable,
                   metadata: AttentionMetadata) -> torch.Tensor | None:
        if self.indexer is not None:
            selected = self.indexer(hidden, q_latent, rope, metadata)
            metadata.backend_cache[SELECTION_KEY] = selected
            return selected
        if SELECTION_KEY not in metadata.backend_cache:
            raise RuntimeError(f"{self.prefix}: a layer without an indexer reuses the previous "
                               f"layer's selection, and no earlier layer made one this step")
        return metadata.backend_cache[SELECTION_KEY]

    def _prefill_selected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                          metadata: AttentionMetadata, seq: int,
                          positions: torch.Tensor) -> torch.Tensor:
        """One sequence's chunk: expanded K/V, masked to each query's selected positions."""
        seq_len = metadata.seq_lens_list[seq]
        ctx = gather_context(cache, metadata.block_tables[seq], seq_len, metadata.block_size)
        ctx = ctx[:, 0].to(q_nope.dtype)  # [L, rank + rope]
        kv = self.kv_b_proj(ctx[:, :self.rank]).view(seq_len, self.num_heads, -1)
        k = torch.cat((kv[..., :self.nope_dim],
                       ctx[:, None, self.rank:].expand(-1, self.num_heads, -1)), dim=-1)
        v = kv[..., self.nope_dim:]
        mask = torch.zeros(positions.shape[0], seq_len + 1, dtype=torch.bool,
                           device=q_nope.device)
        mask.scatter_(1, torch.where(positions < 0, seq_len, positions), True)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return attend_sequence(q, k, v, self.scale, mask[:, :seq_len])

    def _attend_selected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each query over its selected latents only, absorbed weights (``block_tables``:
        one row per query, its sequence's)."""
        w_uk, w_uv = self._kv_b()
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        q = torch.cat((q_lat, q_pe), dim=-1)  # [n, H, rank + rope]
        attend = (sparse_latent_attention_torch if self.sparse_decode_impl != "triton"
                  else _sparse_latent_attention_triton)
        o_lat = attend(q, cache, positions, block_tables, self.rank, self.scale)
        return torch.einsum("nhr,hvr->nhv", o_lat.to(q.dtype), w_uv)

    def extra_repr(self) -> str:
        shared = "" if self.indexer is not None else ", selection=previous layer"
        return super().extra_repr() + shared
