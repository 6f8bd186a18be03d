"""DeepSeek-V4's KV compressor: one compressed entry per ``rate`` tokens, kept in the paged pool.

Each token ``s`` projects a value ``C_s = wkv(h_s)`` and a gate ``Z_s = wgate(h_s)``
(plus a learned per-offset bias ``ape[s % rate]`` on the gate). Window ``w`` is
positions ``w*rate .. w*rate + rate - 1``; its entry is a per-channel softmax-gated
sum, RMS-normed and rotated at position ``w*rate``:

- non-overlapping (HCA): over the ``rate`` tokens of window ``w``;
- overlapping (CSA, and its indexer): values and gates are ``2d`` wide; entry ``w``
  pools the first halves (``Ca``) of window ``w-1``'s tokens with the second
  halves (``Cb``) of window ``w``'s (``2*rate`` slots, stride ``rate``); window 0
  has no previous window (those slots get weight 0).

**State across chunks.** transformers carries a partial-window buffer and the
previous window's ``Ca`` per sequence. Here every token's ``C | Z`` is written to
the token's own slot of the paged pool, and entry ``w`` is written to the slot of
its window's *last* token (``w*rate + rate - 1``). So a chunk that ends mid-window
leaves its tokens' inputs in the pool for the chunk that closes the window, every
block holds only what its own tokens (and earlier ones) determine, prefix caching
reuses exactly the block-aligned state, and preemption recomputes it like K/V.

:func:`compress_windows` is the plain math (the reference the tests use too).
"""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.linear import ReplicatedLinear
from inference_engine.layers.tail_rope import TailRope

__all__ = ["KVCompressor", "V4RMSNorm", "closed_windows", "compress_windows", "paged_rows"]


class V4RMSNorm(nn.Module):
    """RMSNorm computed in float32 with a float32 weight, cast back last (transformers'
    DeepseekV4RMSNorm rounding)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


def paged_rows(cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor, columns: slice = slice(None)) -> torch.Tensor:
    """``cache [num_blocks, block_size, 1, W]`` entries at ``positions`` (any shape, each
    ``>= 0``) of the sequences ``rows`` (same shape: row of ``block_tables``); only
    ``columns`` of each entry are read."""
    bs = cache.shape[1]
    blocks = block_tables[rows, torch.div(positions, bs, rounding_mode="floor")]
    return cache[:, :, 0, columns][blocks, positions % bs]


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
                     has_previous: torch.Tensor, overlap: bool) -> torch.Tensor:
    """Pool windows into entries (before the norm and rotary).

    Args:
        kv, gate: ``[n, slots, width]`` values and raw gates of each window's source
            tokens: overlapping: ``slots = 2*rate`` (window ``w-1`` then ``w``),
            ``width = 2d``; else ``slots = rate``, ``width = d``.
        ape: ``[rate, width]`` float32 gate bias by offset within a window.
        has_previous: ``[n]`` bool, whether window ``w-1`` exists (overlap only).
        overlap: the CSA two-series layout.

    Returns:
        ``[n, d]`` in ``kv``'s dtype.
    """
    # NOTE: the biased gate is float32 (a float32 bias on the projection's output).
    gate = gate.float() + ape.float().repeat(2 if overlap else 1, 1)
    if overlap:
        rate, d = kv.shape[1] // 2, kv.shape[2] // 2
        values = torch.cat((kv[:, :rate, :d], kv[:, rate:, d:]), dim=1)
        gates = torch.cat((gate[:, :rate, :d], gate[:, rate:, d:]), dim=1)
        gates[:, :rate] = gates[:, :rate].masked_fill(~has_previous[:, None, None],
                                                      float("-inf"))
    else:
        values, gates = kv, gate
    weights = gates.softmax(dim=1).to(values.dtype)
    return (values * weights).sum(dim=1)


def closed_windows(metadata: AttentionMetadata, rate: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, windows)``: every window of ``rate`` tokens this step's tokens close, with its
    sequence's row; None when none closes. Made once per step and rate (every layer with that
    rate asks) and kept in ``metadata.backend_cache``."""
    key = f"v4_closed_windows_{rate}"
    if key not in metadata.backend_cache:
        seq_rows: list[int] = []
        windows: list[int] = []
        for i, (q, s) in enumerate(zip(metadata.query_lens_list, metadata.seq_lens_list,
                                       strict=True)):
            first, last = (s - q) // rate, s // rate
            seq_rows += [i] * (last - first)
            windows += range(first, last)
        metadata.backend_cache[key] = (
            (torch.tensor(seq_rows, device=device), torch.tensor(windows, device=device))
            if windows else None)
    return metadata.backend_cache[key]


class KVCompressor(nn.Module):
    """Writes each token's compressor inputs and each closed window's entry to the pool.

    Module names follow DeepSeek's checkpoints (``wkv``, ``wgate``, ``ape``, ``norm``
    under ``...attn.compressor`` / ``...attn.indexer.compressor``).

    Args:
        ctx: the model context.
        prefix: dotted module name.
        head_dim: ``d``, the entry width.
        rate: tokens per window.
        overlap: CSA's overlapping windows (values and gates ``2d`` wide).
        rope: the ``compress`` rotary, applied at each window's first position.
    """

    def __init__(self, ctx: ModelContext, prefix: str, head_dim: int, rate: int,
                 overlap: bool, rope: TailRope) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.prefix = prefix
        self.head_dim = head_dim
        self.rate = rate
        self.overlap = overlap
        self.width = (2 if overlap else 1) * head_dim
        self.wkv = ReplicatedLinear(ctx, cfg.hidden_size, self.width, f"{prefix}.wkv")
        self.wgate = ReplicatedLinear(ctx, cfg.hidden_size, self.width, f"{prefix}.wgate")
        self.ape = nn.Parameter(torch.zeros(rate, self.width), requires_grad=False)
        self.norm = V4RMSNorm(head_dim, cfg.rms_norm_eps)
        self.rope = rope
        self.dtype = ctx.dtype
        # [num_blocks, block_size, 1, 2*width + head_dim]: C | Z | entry, bound by the runner.
        self.kv_cache: tuple[torch.Tensor] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """Per token: its value and gate, and (at a window's last token) the entry."""
        return KVCacheSpec(num_tensors=1, num_heads=1, head_dim=2 * self.width + self.head_dim,
                           dtype=self.dtype)

    @property
    def cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no compressor cache bound")
        return self.kv_cache[0]

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Store this step's tokens (``hidden [T, hidden]``, the attention's input) and the
        entries of every window they close."""
        cache, w = self.cache, self.width
        row = torch.cat((self.wkv(hidden), self.wgate(hidden)), dim=-1)
        cache[metadata.slot_blocks, metadata.slot_offsets, 0, :2 * w] = row.to(cache.dtype)
        closed = closed_windows(metadata, self.rate, hidden.device)
        if closed is None:
            return
        rows, win = closed
        span = 2 * self.rate if self.overlap else self.rate
        start = (win - 1) * self.rate if self.overlap else win * self.rate
        src = start[:, None] + torch.arange(span, device=win.device)  # [n, span]
        inputs = paged_rows(cache, metadata.block_tables, rows[:, None].expand_as(src),
                            src.clamp(min=0), slice(0, 2 * w))
        entries = compress_windows(inputs[..., :w], inputs[..., w:], self.ape, win > 0,
                                   self.overlap)
        entries = self.norm(entries)
        cos, sin = self.rope.cos_sin(win * self.rate)
        entries = self.rope.rotate(entries, cos, sin)
        last_pos = win * self.rate + self.rate - 1
        bs = cache.shape[1]
        blocks = metadata.block_tables[rows, torch.div(last_pos, bs, rounding_mode="floor")]
        cache[blocks, last_pos % bs, 0, 2 * w:] = entries.to(cache.dtype)

    def entries(self, rows: torch.Tensor, indices: torch.Tensor,
                block_tables: torch.Tensor) -> torch.Tensor:
        """Entries ``indices`` (any shape, ``>= 0``) of the sequences ``rows`` (same shape)
        -> ``[..., head_dim]``."""
        last_pos = indices * self.rate + self.rate - 1
        return paged_rows(self.cache, block_tables, rows, last_pos, slice(2 * self.width, None))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rate={self.rate}, overlap={self.overlap}"
