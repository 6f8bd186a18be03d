"""DFlash proposer: a block-diffusion drafter that drafts a whole block in one forward.

Layout followed: z-lab/dflash ``dflash/model.py`` (``DFlashDraftModel``, the v1 drafter;
the DFlash2 candidate selector and convolutions are not supported): Qwen3-style layers
``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``fc [H, len(target_layer_ids) * H]``,
``hidden_norm``, ``norm``; no embedding or LM head of its own (the target's). Config:
``dflash_config`` with ``target_layer_ids`` (target layer *outputs*: transformers'
``hidden_states[id + 1]``), ``mask_token_id``, ``block_size`` (b), optional
``input_embedding_scale``.

Context: the chosen target layers' outputs at every verified position are concatenated,
``hidden_norm(fc(.))`` makes the context feature, and every drafter layer projects it with
its own k/v (and k_norm, rotary at the context position) into its paged cache ("KV
injection"), once per position. Drafting: the block ``[last verified token, mask x (b-1)]``
at positions ``L-1 .. L+b-2``, embedded by the target, attends to the cached context and,
non-causally, to the whole block; rows 1..b-1 through the target's head give
``k = b - 1`` greedy drafts in one forward (a point mass for the rejection sampler).
The block's own K/V land in lookahead slots (k + 1 reserved) and are overwritten later.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inference_engine.config import SpeculativeConfig
from inference_engine.interfaces.attention import KVCacheSpec
from inference_engine.interfaces.proposer import DraftRequest, Proposal, Proposer, ProposerContext
from inference_engine.speculative.draft_sampling import DraftSampler
from inference_engine.speculative.eagle3 import HiddenStateTap, read_attention_geometry
from inference_engine.speculative.paged_drafter_cache import PagedDrafterCache, rms_norm, rope

__all__ = ["DFlashDrafter", "DFlashProposer"]


class _Layer(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, head_dim: int, inter: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.q_proj = nn.Linear(h, heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(heads * head_dim, h, bias=bias, dtype=dtype)
        self.q_norm = nn.Parameter(torch.ones(head_dim, dtype=dtype))
        self.k_norm = nn.Parameter(torch.ones(head_dim, dtype=dtype))
        self.gate_proj = nn.Linear(h, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, h, bias=False, dtype=dtype)


class DFlashDrafter(nn.Module):
    """The drafter's weights and its two passes (context K/V, block forward)."""

    def __init__(self, cfg: dict[str, Any], num_targets: int, dtype: torch.dtype) -> None:
        super().__init__()
        h = read_attention_geometry(self, cfg)
        bias = bool(cfg.get("attention_bias", False))
        self.layers = nn.ModuleList(
            _Layer(h, self.num_heads, self.num_kv_heads, self.head_dim,
                   cfg["intermediate_size"], bias, dtype)
            for _ in range(cfg["num_hidden_layers"]))
        self.fc = nn.Linear(num_targets * h, h, bias=False, dtype=dtype)
        self.hidden_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.norm = nn.Parameter(torch.ones(h, dtype=dtype))

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors in by name (z-lab/dflash names).

        Raises:
            ValueError: a missing or misshapen tensor, named.
        """
        state = self.state_dict()
        for ours, target in state.items():
            name = ours
            for short in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                name = name.replace(f".{short}", f".self_attn.{short}")
            for short in ("gate_proj", "up_proj", "down_proj"):
                name = name.replace(f".{short}", f".mlp.{short}")
            if not name.endswith((".weight", ".bias")):
                name += ".weight"
            if name not in tensors:
                raise ValueError(f"DFlash checkpoint is missing {name!r}")
            if tuple(tensors[name].shape) != tuple(target.shape):
                raise ValueError(f"DFlash tensor {name!r} has shape "
                                 f"{tuple(tensors[name].shape)}, expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensors[name].to(target.dtype))

    def _kv(self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        k = layer.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        k = rope(rms_norm(k, layer.k_norm, self.eps), positions, self.rope_theta)
        return k, layer.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)

    def write_context(self, features: torch.Tensor, positions: torch.Tensor,
                      caches: list[PagedDrafterCache], block_tables: list[Sequence[int]],
                      rows_per_seq: list[int]) -> None:
        """Every layer's K/V of the context feature ``[T, n * H]`` at ``positions``."""
        context = rms_norm(self.fc(features), self.hidden_norm, self.eps)
        for layer, cache in zip(self.layers, caches, strict=True):
            k, v = self._kv(layer, context, positions)
            cache.write(k, v, positions, block_tables, rows_per_seq)

    def draft_block(self, embeds: torch.Tensor, positions: torch.Tensor,
                    caches: list[PagedDrafterCache], block_tables: list[Sequence[int]],
                    rows_per_seq: list[int]) -> torch.Tensor:
        """The blocks' embeddings ``[T, H]`` -> final-normed ``[T, H]`` (non-causal)."""
        hidden = embeds
        for layer, cache in zip(self.layers, caches, strict=True):
            residual = hidden
            x = rms_norm(hidden, layer.input_layernorm, self.eps)
            q = layer.q_proj(x).view(-1, self.num_heads, self.head_dim)
            q = rope(rms_norm(q, layer.q_norm, self.eps), positions, self.rope_theta)
            k, v = self._kv(layer, x, positions)
            attn = cache.attend(q, k, v, positions, block_tables, rows_per_seq, causal=False)
            hidden = residual + layer.o_proj(attn.reshape(len(hidden), -1))
            residual = hidden
            x = rms_norm(hidden, layer.post_attention_layernorm, self.eps)
            hidden = residual + layer.down_proj(
                nn.functional.silu(layer.gate_proj(x)) * layer.up_proj(x))
        return rms_norm(hidden, self.norm, self.eps)


class DFlashProposer(Proposer):
    """``{"method": "dflash", "model": PATH, "num_speculative_tokens": k}`` (k <= b - 1).

    Raises:
        ValueError: no ``model``, a config without ``dflash_config`` keys, k >= block_size,
            a mask token outside the vocabulary (all named).
    """

    reads_target_hidden_states = True

    supports_probabilistic_drafts = True

    def __init__(self, spec: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(spec, context)
        self.draft_sampler = DraftSampler(spec.draft_sample_method, context.config.model.seed)
        if not spec.model:
            raise ValueError("speculative_config 'model' is required for method dflash (the "
                             "DFlash drafter's folder)")
        from safetensors.torch import load_file

        path = Path(spec.model)
        cfg = json.loads((path / "config.json").read_text())
        dcfg = cfg.get("dflash_config") or {}
        missing = [k for k in ("target_layer_ids", "mask_token_id") if dcfg.get(k) is None]
        if missing:
            raise ValueError(f"DFlash drafter {spec.model!r}: dflash_config lacks {missing}")
        self.block_size = int(dcfg.get("block_size", 16))
        if spec.num_speculative_tokens > self.block_size - 1:
            raise ValueError(f"speculative_config 'num_speculative_tokens' "
                             f"({spec.num_speculative_tokens}) exceeds the DFlash block size "
                             f"- 1 ({self.block_size - 1})")
        self.mask_token_id = int(dcfg["mask_token_id"])
        if not 0 <= self.mask_token_id < context.vocab_size:
            raise ValueError(f"dflash_config mask_token_id {self.mask_token_id} is outside the "
                             f"target's vocabulary ({context.vocab_size})")
        self.embedding_scale = float(dcfg.get("input_embedding_scale", 1.0))
        target_ids = [int(i) for i in dcfg["target_layer_ids"]]
        device = context.platform.device()
        with torch.device(device):
            self.drafter = DFlashDrafter(cfg, len(target_ids), context.dtype)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(file))
        self.drafter.load(tensors)
        self.drafter.eval()
        self.target = context.target_model
        # Layer outputs: transformers' hidden_states[id + 1].
        self.tap = HiddenStateTap(context.target_model, [i + 1 for i in target_ids])
        self.caches = [PagedDrafterCache(self.drafter.num_kv_heads, self.drafter.head_dim,
                                         context.block_size, context.dtype, device)
                       for _ in self.drafter.layers]
        self._done: dict[str, int] = {}
        self._pending: dict[str, list[tuple[int, torch.Tensor]]] = {}

    @property
    def num_lookahead_slots(self) -> int:
        # The block reaches position L - 1 + k while the target holds L - 1 + k slots.
        return self.num_speculative_tokens + 1

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [c.spec() for c in self.caches]

    def bind_kv_cache(self, num_blocks: int) -> None:
        for cache in self.caches:
            cache.allocate(num_blocks)
        self.tap.disable_fused_decode()

    def remove(self, request_id: str) -> None:
        self._done.pop(request_id, None)
        self._pending.pop(request_id, None)

    def on_target_step(self, request_ids: Sequence[str], num_computed: Sequence[int],
                       query_lens: Sequence[int]) -> None:
        record_rows(self._pending, self._done, self.tap.take(), request_ids, num_computed,
                    query_lens)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_drafts > 0]
        if not active:
            return Proposal(drafts)
        device = self.caches[0].device
        feats, ctx_pos, ctx_rows, tables = [], [], [], []
        for i in active:
            r = requests[i]
            last = len(r.token_ids) - 2
            done = self._done.get(r.request_id, 0)
            feats.append(take_rows(self._pending, r.request_id, done, last))
            ctx_pos.append(torch.arange(done, last + 1))
            ctx_rows.append(last + 1 - done)
            tables.append(r.block_ids)
            self._done[r.request_id] = last + 1
        self.drafter.write_context(torch.cat(feats), torch.cat(ctx_pos).to(device),
                                   self.caches, tables, ctx_rows)
        b = self.num_speculative_tokens + 1
        block_ids = torch.full((len(active), b), self.mask_token_id, dtype=torch.int64)
        block_ids[:, 0] = torch.tensor([requests[i].token_ids[-1] for i in active])
        starts = torch.tensor([len(requests[i].token_ids) - 1 for i in active])
        positions = (starts[:, None] + torch.arange(b)[None, :]).reshape(-1).to(device)
        embeds = self.target.embed(block_ids.reshape(-1).to(device)) * self.embedding_scale
        hidden = self.drafter.draft_block(embeds, positions, self.caches, tables,
                                          [b] * len(active))
        rows = hidden.view(len(active), b, -1)[:, 1:].reshape(-1, hidden.shape[-1])
        logits = self.target.compute_logits(rows).view(len(active), b - 1, -1)
        if not self.draft_sampler.is_probabilistic:
            picked = logits.argmax(-1).tolist()
            for j, i in enumerate(active):
                drafts[i] = [int(t) for t in picked[j][: requests[i].max_drafts]]
            return Proposal(drafts)
        # Each block position's draft is drawn from its own q (which ignores the drafts
        # before it: a valid draft distribution, so verification stays lossless).
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        asks = [requests[i] for i in active]
        for pos in range(b - 1):
            picked, q = self.draft_sampler.pick(
                logits[:, pos], [r.params for r in asks],
                [list(r.token_ids[r.num_prompt_tokens:]) + drafts[i]
                 for r, i in zip(asks, active, strict=True)],
                [r.token_ids[:r.num_prompt_tokens] for r in asks])
            for j, i in enumerate(active):
                if pos < requests[i].max_drafts:
                    drafts[i].append(int(picked[j]))
                    if q[j] is not None:
                        probs[i].append(q[j])
        return Proposal(drafts, [torch.stack(p) if p else None for p in probs])


def record_rows(pending: dict[str, list[tuple[int, torch.Tensor]]], done: dict[str, int],
                states: torch.Tensor, request_ids: Sequence[str], num_computed: Sequence[int],
                query_lens: Sequence[int]) -> None:
    """Keep each request's rows of a target forward by position; rows from a chunk's start
    on supersede older ones (recompute, rejected drafts), and the drafter redoes them."""
    offset = 0
    for rid, start, n in zip(request_ids, num_computed, query_lens, strict=True):
        rows = states[offset : offset + n]
        offset += n
        kept = [(s, t[: max(0, start - s)]) for s, t in pending.get(rid, []) if s < start]
        pending[rid] = [*[(s, t) for s, t in kept if len(t)], (start, rows)]
        done[rid] = min(done.get(rid, start), start)


def take_rows(pending: dict[str, list[tuple[int, torch.Tensor]]], rid: str, first: int,
              last: int) -> torch.Tensor:
    """The recorded rows of positions ``first..last`` (contiguous); later ones are kept."""
    parts = []
    for start, rows in pending.get(rid, []):
        lo, hi = max(first, start), min(last + 1, start + len(rows))
        if lo < hi:
            parts.append(rows[lo - start : hi - start])
    if not parts and last >= first:
        raise RuntimeError(f"target hidden states of positions {first}..{last} of request "
                           f"{rid} were not recorded")
    feat = torch.cat(parts) if parts else None
    if feat is not None and len(feat) != last + 1 - first:
        raise RuntimeError(f"target hidden states of positions {first}..{last} of request "
                           f"{rid} were not recorded")
    pending[rid] = [(s, r) for s, r in pending.get(rid, []) if s + len(r) > last]
    return feat
