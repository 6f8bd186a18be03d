"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, model type ``deepseek_v4``).

Per layer (``layer_types``):

- every layer: q-LoRA queries (``wq_a`` -> ``q_norm`` -> ``wq_b``, then an unweighted
  per-head RMSNorm), one shared K=V head (``wkv`` -> ``norm``), interleaved rotary on
  the trailing ``qk_rope_head_dim`` channels, per-head sinks, a sliding window of
  ``sliding_window`` tokens, the rotary undone on the output, and a grouped low-rank
  output projection (``wo_a`` per group of heads, then ``wo_b``);
- ``compressed_sparse_attention`` (CSA): plus compressed entries (one per
  ``compress_rates[csa]`` tokens, overlapping windows) of which an indexer keeps the
  ``index_topk`` best per query;
- ``heavily_compressed_attention`` (HCA): plus all entries of non-overlapping windows
  of ``compress_rates[hca]`` tokens.

Sliding layers rotate with the ``main`` rope, compressed ones with ``compress``
(``compress_rope_theta``, YaRN when configured). The residual is ``hc_mult``
hyper-connected streams (:mod:`~inference_engine.layers.hyper_connection`). MLPs
(``mlp_layer_types``) are MoE with ``sqrtsoftplus`` scores: ``hash_moe`` picks the
experts from the token id (``tid2eid``), ``moe`` by top-k of scores plus a correction
bias; experts and the shared expert clamp gate/up at ``swiglu_limit``.

Token ids reach the hash-routed layers without engine changes: every model's forward
already receives the step's ``input_ids``; this decoder hands them to its MoE layers.

Cache: per layer one K=V row per token; on CSA/HCA layers the compressor's per-token
inputs and entries (:mod:`~inference_engine.layers.kv_compressor`), on CSA layers the
indexer compressor's too. All of it is per-token, block-aligned state in the paged
pool: chunked prefill, preemption (recompute) and prefix caching need nothing else.

Checkpoint names are DeepSeek's (what transformers' ``save_pretrained`` writes):
``embed``/``head``, ``attn.wq_a``..., ``ffn.experts.N.w1``..., ``hc_attn_fn``...;
transformers' in-memory names (``self_attn.q_a_proj``, stacked ``mlp.experts.gate_up_proj``...)
load too; ``mtp.*`` tensors are skipped (no multi-token prediction).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import CausalLM, ModelContext
from inference_engine.layers.compressed_attention import (
    CompressedIndexer,
    sink_attention,
    visible_entries,
    window_span,
)
from inference_engine.layers.embedding import LMHead, VocabEmbedding
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.hyper_connection import HyperConnection, HyperHead, unweighted_rms_norm
from inference_engine.layers.kv_compressor import KVCompressor, V4RMSNorm, paged_rows
from inference_engine.layers.linear import ReplicatedLinear
from inference_engine.layers.moe import ExpertActivation
from inference_engine.layers.moe.layer import FusedMoE
from inference_engine.layers.tail_rope import TailRope
from inference_engine.layers.weights import load_checkpoint_weights
from torch import nn

__all__ = ["DeepseekV4ForCausalLM"]

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
ATTENTION_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
# Float32 score elements (queries x heads x keys) one prefill tile may make (128 MiB).
SCORE_BUDGET = 1 << 25
SCORING = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


def _rope_params(cfg: object, label: str) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params.get(label), dict):
        return params[label]
    theta = cfg.rope_theta if label == "main" else cfg.compress_rope_theta
    return {"rope_type": "default", "rope_theta": theta}


# --------------------------------------------------------------------------- #
# Attention
# --------------------------------------------------------------------------- #


class DeepseekV4Attention(nn.Module):
    """One layer's attention (see the module docstring); holds the K=V rows of its tokens.

    Args:
        ctx: the model context.
        prefix: ``model.layers.N.attn``.
        kind: the layer type.
        ropes: ``{"main": TailRope, "compress": TailRope}``.
    """

    def __init__(self, ctx: ModelContext, prefix: str, kind: str,
                 ropes: dict[str, TailRope]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.prefix = prefix
        self.kind = kind
        self.num_heads = h = cfg.num_attention_heads
        self.head_dim = d = cfg.head_dim
        self.window = cfg.sliding_window
        self.groups = g = cfg.o_groups
        self.eps = cfg.rms_norm_eps
        if (h * d) % g:
            raise ValueError(f"{prefix}: o_groups ({g}) must divide num_attention_heads * "
                             f"head_dim ({h * d})")
        if getattr(cfg, "num_key_value_heads", 1) != 1:
            raise ValueError(f"{prefix}: DeepSeek-V4 attention has one shared K=V head; "
                             f"num_key_value_heads={cfg.num_key_value_heads} is not supported")
        self.rope_label = "main" if kind == SLIDING else "compress"
        self.rope = ropes[self.rope_label]
        self.wq_a = ReplicatedLinear(ctx, cfg.hidden_size, cfg.q_lora_rank, f"{prefix}.wq_a")
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = ReplicatedLinear(ctx, cfg.q_lora_rank, h * d, f"{prefix}.wq_b")
        self.wkv = ReplicatedLinear(ctx, cfg.hidden_size, d, f"{prefix}.wkv")
        self.norm = V4RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = ReplicatedLinear(ctx, h * d // g, g * cfg.o_lora_rank, f"{prefix}.wo_a")
        self.wo_b = ReplicatedLinear(ctx, g * cfg.o_lora_rank, cfg.hidden_size, f"{prefix}.wo_b")
        weight = getattr(self.wo_a, "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.is_floating_point()
                and weight.element_size() >= 2
                and tuple(weight.shape) == (g * cfg.o_lora_rank, h * d // g)):
            raise ValueError(f"{prefix}.wo_a: the grouped output projection reads a plain "
                             f"weight; quantized DeepSeek-V4 checkpoints are not supported")
        self.attn_sink = nn.Parameter(torch.zeros(h), requires_grad=False)
        self.scale = d ** -0.5
        self.compressor: KVCompressor | None = None
        self.indexer: CompressedIndexer | None = None
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"{prefix}: sliding_window must be a positive integer, got "
                             f"{self.window!r}")
        if kind != SLIDING:
            rate = (getattr(cfg, "compress_rates", None) or {}).get(kind)
            if not isinstance(rate, int) or rate < 1:
                raise ValueError(f"{prefix}: compress_rates[{kind!r}] must be a positive "
                                 f"integer, got {rate!r}")
            self.rate = rate
            self.compressor = KVCompressor(ctx, f"{prefix}.compressor", d, rate, kind == CSA,
                                           ropes["compress"])
            if kind == CSA:
                self.indexer = CompressedIndexer(ctx, f"{prefix}.indexer", rate,
                                                 ropes["compress"])
        self.dtype = ctx.dtype
        # The decode attention over gathered rows, chosen once: the Triton kernel where the
        # platform lists Triton, else the torch reference.
        self.decode_attention = sink_attention
        if choose_fused_op(getattr(ctx, "device", None)) == "triton":
            from inference_engine.layers.triton_sink_attention import sink_attention_triton

            self.decode_attention = sink_attention_triton
        # [num_blocks, block_size, 1, head_dim]: the K=V row of each token, bound by the runner.
        self.kv_cache: tuple[torch.Tensor] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """One K=V row of ``head_dim`` per token."""
        return KVCacheSpec(num_tensors=1, num_heads=1, head_dim=self.head_dim, dtype=self.dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                rope_cs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden [T, hidden]`` (normed) -> ``[T, hidden]``."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no KV cache bound")
        t, h, d = hidden.shape[0], self.num_heads, self.head_dim
        cos, sin = rope_cs[self.rope_label]
        q_residual = self.q_norm(self.wq_a(hidden))
        q = unweighted_rms_norm(self.wq_b(q_residual).view(t, h, d), self.eps)
        q = self.rope.rotate(q, cos, sin)
        kv = self.rope.rotate(self.norm(self.wkv(hidden)), cos, sin)  # [T, D]
        (cache,) = self.kv_cache
        cache[metadata.slot_blocks, metadata.slot_offsets, 0] = kv.to(cache.dtype)
        selection = None
        if self.compressor is not None:
            self.compressor(hidden, metadata)
            if self.indexer is not None:
                selection = self.indexer(hidden, q_residual, positions, rope_cs["compress"],
                                         metadata)
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
        n = metadata.num_decodes
        if n:
            out[:n] = self._decode(q[:n], positions[:n], selection, metadata)
        starts = metadata.query_start_loc.tolist()
        for i in range(n, metadata.num_seqs):
            start, end = starts[i], starts[i + 1]
            out[start:end] = self._prefill(
                i, q[start:end], positions[start:end],
                None if selection is None else selection[start:end], metadata)
        out = self.rope.rotate(out, cos, -sin)
        grouped = out.reshape(t, self.groups, -1)  # [T, G, H*D/G]
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [G, R, H*D/G]
        low_rank = torch.einsum("tgi,gri->tgr", grouped, weight).reshape(t, -1)
        return self.wo_b(low_rank)

    def _decode(self, q: torch.Tensor, q_pos: torch.Tensor, selection: torch.Tensor | None,
                metadata: AttentionMetadata) -> torch.Tensor:
        """One query per sequence: its window rows plus its visible or selected entries."""
        n, device = q.shape[0], q.device
        (cache,) = self.kv_cache
        rows = torch.arange(n, device=device)[:, None]
        pos = q_pos[:, None] - torch.arange(self.window - 1, -1, -1, device=device)  # [n, W]
        valid = pos >= 0
        keys = paged_rows(cache, metadata.block_tables, rows.expand_as(pos), pos.clamp(min=0))
        if self.compressor is not None:
            if selection is not None:
                idx = selection[:n]
                ok = idx >= 0
            else:
                width = max(s // self.rate for s in metadata.seq_lens_list[:n])
                idx = torch.arange(width, device=device)[None, :].expand(n, -1)
                ok = visible_entries(q_pos, width, self.rate)
            if idx.shape[1]:
                entries = self.compressor.entries(rows.expand_as(idx), idx.clamp(min=0),
                                                  metadata.block_tables)
                keys = torch.cat((keys, entries), dim=1)
                valid = torch.cat((valid, ok), dim=1)
        keys = keys.masked_fill(~valid[..., None], 0.0)  # unwritten slots may hold anything
        return self.decode_attention(q, keys, valid, self.attn_sink, self.scale)

    def _prefill(self, row: int, q: torch.Tensor, q_pos: torch.Tensor,
                 selection: torch.Tensor | None, metadata: AttentionMetadata) -> torch.Tensor:
        """One sequence's chunk: its window span and entries gathered once, attended in tiles
        of queries (each tile reads only its own window span and the entries closed by its
        last query) so the float32 scores stay within :data:`SCORE_BUDGET` elements."""
        (cache,) = self.kv_cache
        n, device = q.shape[0], q.device
        seq_len = metadata.seq_lens_list[row]
        first = seq_len - n
        lo = max(0, first - self.window + 1)
        span = window_span(cache, metadata.block_tables, row, lo, seq_len)
        span_pos = torch.arange(lo, seq_len, device=device)
        num = seq_len // self.rate if self.compressor is not None else 0
        entries = picked = None
        if num:
            idx = torch.arange(num, device=device)
            entries = self.compressor.entries(torch.full_like(idx, row), idx,
                                              metadata.block_tables)
            if selection is not None:
                picked = torch.zeros(n, num + 1, dtype=torch.bool, device=device)
                picked.scatter_(1, torch.where(selection < 0, num, selection), True)
        tile = max(16, SCORE_BUDGET // (self.num_heads * (self.window + num + 16)))
        if tile >= n:
            tile = n
        out = torch.empty_like(q)
        for a in range(0, n, tile):
            b = min(n, a + tile)
            tile_pos = q_pos[a:b]
            w_lo = max(lo, first + a - self.window + 1) - lo
            keys, k_pos = span[w_lo:first + b - lo], span_pos[w_lo:first + b - lo]
            mask = ((k_pos[None, :] <= tile_pos[:, None])
                    & (k_pos[None, :] > tile_pos[:, None] - self.window))
            closed = (first + b) // self.rate if num else 0
            if closed:
                seen = visible_entries(tile_pos, closed, self.rate)
                if picked is not None:
                    seen = seen & picked[a:b, :closed]
                keys = torch.cat((keys, entries[:closed]), dim=0)
                mask = torch.cat((mask, seen), dim=1)
            out[a:b] = sink_attention(q[a:b], keys, mask, self.attn_sink, self.scale)
        return out


# --------------------------------------------------------------------------- #
# MoE
# --------------------------------------------------------------------------- #


class DeepseekV4Gate(nn.Module):
    """Router: ``weight`` scores every expert; a ``hash`` gate takes the experts from
    ``tid2eid[token]``, else top-k of ``score + bias`` (``bias`` is the correction bias)."""

    def __init__(self, ctx: ModelContext, is_hash: bool) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.is_hash = is_hash
        self.top_k = cfg.num_experts_per_tok
        self.scaling = cfg.routed_scaling_factor
        self.renormalize = bool(getattr(cfg, "norm_topk_prob", True))
        if cfg.scoring_func not in SCORING:
            raise ValueError(f"scoring_func {cfg.scoring_func!r} is not one of {sorted(SCORING)}")
        self.score = SCORING[cfg.scoring_func]
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size,
                                               dtype=ctx.dtype), requires_grad=False)
        if is_hash:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, self.top_k,
                                                    dtype=torch.int64), requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]``, ``token_ids [T]`` -> ``(weights [T, k] float32, ids [T, k])``."""
        scores = self.score(F.linear(x, self.weight)).float()
        if self.is_hash:
            ids = self.tid2eid[token_ids]
        else:
            ids = (scores + self.bias.float()).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class ClampedSwiGLU(nn.Module):
    """The shared expert: ``w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))``."""

    def __init__(self, ctx: ModelContext, hidden_size: int, intermediate_size: int,
                 prefix: str) -> None:
        super().__init__()
        self.limit = ctx.hf_config.swiglu_limit
        self.w1 = ReplicatedLinear(ctx, hidden_size, intermediate_size, f"{prefix}.w1")
        self.w3 = ReplicatedLinear(ctx, hidden_size, intermediate_size, f"{prefix}.w3")
        self.w2 = ReplicatedLinear(ctx, intermediate_size, hidden_size, f"{prefix}.w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class DeepseekV4MoE(nn.Module):
    """Routed experts (hash- or score-routed) plus the shared expert (``ffn.*``)."""

    def __init__(self, ctx: ModelContext, prefix: str, is_hash: bool) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.gate = DeepseekV4Gate(ctx, is_hash)
        self.experts = FusedMoE(ctx, cfg.n_routed_experts, cfg.hidden_size,
                                cfg.moe_intermediate_size, f"{prefix}.experts",
                                ExpertActivation("silu_clamped", limit=cfg.swiglu_limit),
                                expert_names=("w1", "w3", "w2"))
        self.shared_experts = ClampedSwiGLU(ctx, cfg.hidden_size, cfg.moe_intermediate_size,
                                            f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, token_ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)


# --------------------------------------------------------------------------- #
# Layers and model
# --------------------------------------------------------------------------- #


class DeepseekV4Layer(nn.Module):
    """Hyper-connected attention and MoE blocks (``model.layers.N``)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, ropes: dict[str, TailRope]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        prefix = f"model.layers.{layer_idx}"
        kind, mlp_kind = cfg.layer_types[layer_idx], cfg.mlp_layer_types[layer_idx]
        if kind not in ATTENTION_TYPES:
            raise ValueError(f"{prefix}: layer type {kind!r} is not one of {ATTENTION_TYPES}")
        if mlp_kind not in MLP_TYPES:
            raise ValueError(f"{prefix}: mlp_layer_types entry {mlp_kind!r} is not one of "
                             f"{MLP_TYPES}")

        def hc() -> HyperConnection:
            return HyperConnection(cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters,
                                   cfg.hc_eps, cfg.rms_norm_eps)

        self.hc_attn, self.hc_ffn = hc(), hc()
        self.attn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DeepseekV4Attention(ctx, f"{prefix}.attn", kind, ropes)
        self.ffn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = DeepseekV4MoE(ctx, f"{prefix}.ffn", mlp_kind == "hash_moe")

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                rope_cs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                metadata: AttentionMetadata) -> torch.Tensor:
        """``streams [T, hc_mult, hidden]`` -> the same."""
        collapsed, post, comb = self.hc_attn(streams)
        out = self.attn(self.attn_norm(collapsed), positions, rope_cs, metadata)
        streams = HyperConnection.merge(streams, out, post, comb)
        collapsed, post, comb = self.hc_ffn(streams)
        out = self.ffn(self.ffn_norm(collapsed), token_ids)
        return HyperConnection.merge(streams, out, post, comb)


class DeepseekV4Model(nn.Module):
    """Embedding, layers, the final stream collapse and norm (the ``model.`` prefix)."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.hc_mult = cfg.hc_mult
        rot_dim = int(cfg.head_dim * (getattr(cfg, "partial_rotary_factor", None)
                                      or 64 / cfg.head_dim))
        if rot_dim % 2 or rot_dim > cfg.head_dim:
            raise ValueError(f"rotary width {rot_dim} (head_dim * partial_rotary_factor) must "
                             f"be even and at most head_dim ({cfg.head_dim})")
        max_pos = cfg.max_position_embeddings
        self.ropes = {label: TailRope(_rope_params(cfg, label), rot_dim, max_pos)
                      for label in ("main", "compress")}
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype)
        self.layers = nn.ModuleList(DeepseekV4Layer(ctx, i, self.ropes)
                                    for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        rope_cs = {label: rope.cos_sin(positions) for label, rope in self.ropes.items()}
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, rope_cs, metadata)
        return self.norm(self.hc_head(streams))


# (pattern, replacement) from checkpoint names (DeepSeek's, with or without ``model.``) to ours.
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r) for p, r in (
        (r"^model\.", ""),
        (r"^head\.", "lm_head."),
        (r"^embed\.", "embed_tokens."),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
        (r"^(?!lm_head\.)", "model."),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2"),
        # transformers v5's in-memory names (a state_dict), which save_pretrained renames back.
        (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.",
         ".attn.indexer.weights_proj."),
        (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
        (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
        (r"\.self_attn\.", ".attn."),
        (r"\.mlp\.", ".ffn."),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.(attn|ffn)_hc\.", r".hc_\1."),
        (r"\.attn\.sinks$", ".attn.attn_sink"),
        (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
        (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
        (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
        (r"\.o_(a|b)_proj\.", r".wo_\1."),
        (r"\.kv_proj\.", ".wkv."),
        (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
        (r"\.kv_norm\.", ".norm."),
        (r"\.position_bias$", ".ape"),
        (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
        (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
        (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
        (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    ))
_SKIPPED = re.compile(r"(^|\.)mtp\.")


def checkpoint_to_ours(name: str) -> str:
    """A DeepSeek-V4 checkpoint name -> our parameter name."""
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


class DeepseekV4ForCausalLM(CausalLM):
    """The V4 decoder (see the module docstring).

    Raises:
        ValueError: an unknown layer or MLP type, several KV heads, a rotary width that
            does not fit, or a float8 KV cache (not implemented for V4's compressed state).
    """

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        kv_dtype = getattr(ctx, "kv_cache_dtype", None)
        if kv_dtype is not None and kv_dtype not in (ctx.dtype, torch.float32, torch.bfloat16,
                                                     torch.float16):
            raise ValueError(f"DeepseekV4ForCausalLM: kv cache dtype {kv_dtype} is not "
                             f"supported (its compressed state is kept in the model dtype)")
        if bool(getattr(cfg, "tie_word_embeddings", False)):
            raise ValueError("DeepseekV4ForCausalLM: tie_word_embeddings is not supported")
        self.model = DeepseekV4Model(ctx)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load DeepSeek's checkpoint names; returns the checkpoint names consumed (skipped
        ``mtp.*`` tensors included)."""
        skipped: set[str] = set()
        sources: dict[str, str] = {}

        def translated() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if _SKIPPED.search(name):
                    skipped.add(name)
                    continue
                ours = checkpoint_to_ours(name)
                sources[ours] = name
                yield ours, tensor

        consumed = load_checkpoint_weights(self, translated())
        return {sources.get(name, name) for name in consumed} | skipped
