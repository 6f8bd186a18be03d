"""GQA attention restricted to the key blocks an MSA indexer keeps (MiniMax-M3 sparse layers).

Each KV head ``g`` has its own selection (``[n, G, k]`` block ids of
``index_block_size`` positions, from
:class:`~inference_engine.layers.msa_indexer.MSAIndexer`), shared by the query
heads of its group. Decodes gather only the kept blocks' K/V from the paged
pool (``k * index_block_size`` positions per KV head, however long the context:
:func:`block_sparse_decode`); a prefill chunk expands its sequence's K/V and
masks every key outside each query's kept blocks (:func:`block_sparse_mask`),
causally. A float8 cache is read back with the layer's per-tensor scales.
"""

from __future__ import annotations

import torch

__all__ = ["block_sparse_decode", "block_sparse_mask"]


def block_sparse_mask(selection: torch.Tensor, q_positions: torch.Tensor, seq_len: int,
                      block_size: int, heads_per_group: int) -> torch.Tensor:
    """Boolean ``[H, n, seq_len]``: True where query head ``h`` of query ``i`` may attend.

    Args:
        selection: ``[n, G, k]`` kept block ids per KV head, ``-1`` for none.
        q_positions: ``[n]`` each query's position.
        seq_len: the context length the mask covers.
        block_size: positions per indexer block.
        heads_per_group: query heads per KV head.
    """
    n, g, _ = selection.shape
    num_blocks = -(-seq_len // block_size)
    keep = torch.zeros(n, g, num_blocks + 1, dtype=torch.bool, device=selection.device)
    keep.scatter_(-1, torch.where(selection < 0, num_blocks, selection), True)
    block_of = torch.arange(seq_len, device=selection.device) // block_size
    mask = keep[..., :num_blocks][..., block_of]  # [n, G, seq_len]
    causal = torch.arange(seq_len, device=selection.device)[None, :] <= q_positions[:, None]
    mask = mask & causal[:, None, :]
    return mask.transpose(0, 1).repeat_interleave(heads_per_group, dim=0)


def block_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        selection: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, block_size: int, scale: float,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query per sequence over its kept blocks only.

    Args:
        q: ``[n, H, D]`` queries (the last position of each sequence).
        k_cache, v_cache: the layer's pool views ``[num_blocks, page_size, G, D]``.
        selection: ``[n, G, k]`` kept indexer-block ids per KV head, ``-1`` for none.
        block_tables: ``[n, max_pages]`` each sequence's page ids.
        seq_lens: ``[n]`` context lengths (the query is at ``seq_len - 1``).
        block_size: positions per indexer block.
        scale: softmax scale.
        k_scale, v_scale: a float8 cache's per-tensor scales.

    Returns:
        ``[n, H, D]`` in ``q``'s dtype.
    """
    n, h, d = q.shape
    g, k = selection.shape[1], selection.shape[2]
    page = k_cache.shape[1]
    offsets = torch.arange(block_size, device=q.device)
    pos = (selection.clamp(min=0)[..., None] * block_size + offsets).reshape(n, g, k * block_size)
    valid = (selection >= 0).repeat_interleave(block_size, dim=-1)
    valid &= pos < seq_lens[:, None, None]
    pos = torch.where(valid, pos, 0)
    pages = block_tables.gather(1, (pos // page).reshape(n, -1)).view(n, g, -1)
    heads = torch.arange(g, device=q.device)[None, :, None]
    keys = k_cache[pages, pos % page, heads].float() * k_scale  # [n, G, K, D]
    values = v_cache[pages, pos % page, heads].float() * v_scale
    # NOTE: padded picks read slot 0 of a page; zero them so nothing non-finite leaks in.
    keys = keys.masked_fill(~valid[..., None], 0.0)
    values = values.masked_fill(~valid[..., None], 0.0)
    qg = q.float().view(n, g, h // g, d)
    scores = torch.einsum("ngrd,ngkd->ngrk", qg, keys) * scale
    probs = scores.masked_fill(~valid[:, :, None, :], float("-inf")).softmax(dim=-1)
    out = torch.einsum("ngrk,ngkd->ngrd", probs, values)
    return out.reshape(n, h, d).to(q.dtype)
