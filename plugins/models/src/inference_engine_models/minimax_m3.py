"""MiniMax-M3 text (``MiniMaxM3VLForCausalLM``, model type ``minimax_m3_vl_text``).

Per layer, ``layer_types`` picks the attention: ``full_attention`` (dense GQA) or
``minimax_m3_sparse`` (MSA: an :class:`~inference_engine.layers.msa_indexer.MSAIndexer`
keeps ``index_topk_blocks`` blocks of ``index_block_size`` keys per query and KV
head, and the GQA attention reads only those,
:mod:`~inference_engine.layers.block_sparse_attention`); ``mlp_layer_types``
picks the MLP: ``dense`` or ``sparse`` (MoE: sigmoid router with
``e_score_correction_bias``, renormalised, times ``routed_scaling_factor``, plus
one shared expert). Every MLP uses SwiGLU-OAI (gate clamped at ``swiglu_limit``,
up at +-limit, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``), every norm is
Gemma-style (``1 + weight``), q/k are normalised per head, and rotary is partial
(``rope_parameters.partial_rotary_factor``; ``rotary_dim`` is unused, as in
transformers).

The VL checkpoint (``MiniMaxM3SparseForConditionalGeneration``) runs text-only:
its ``text_config`` builds this model and the vision tower's tensors are skipped.
Checkpoint names are transformers v5's; MiniMax's original names
(``block_sparse_moe``, per-expert ``w1/w3/w2``, ``index_q_proj``..., separate
dense ``gate_proj``/``up_proj``, the ``language_model.`` prefix) are translated
as transformers' conversion mapping does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from inference_engine.builtin.attention.attention_reference import dequantize
from inference_engine.builtin.attention.common import attend_sequence, gather_context, write_kv
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import DecoderAttention, DecoderForCausalLM, RotaryTable
from inference_engine.layers.block_sparse_attention import block_sparse_decode, block_sparse_mask
from inference_engine.layers.decoder import DecoderOptions, NormRotateQK
from inference_engine.layers.linear import ReplicatedLinear
from inference_engine.layers.moe import ExpertActivation, RouterSpec, SparseMoeBlock
from inference_engine.layers.moe.activation import gated_activation
from inference_engine.layers.msa_indexer import MSAIndexer, OffsetRMSNorm
from inference_engine.layers.rotary import rope_parameters
from inference_engine.layers.weights import load_checkpoint_weights
from torch import nn

__all__ = ["MiniMaxM3Attention", "MiniMaxM3MoeBlock", "MiniMaxM3SparseForConditionalGeneration",
           "MiniMaxM3VLForCausalLM", "SwigluOAIMLP"]

ATTENTION_TYPES = ("full_attention", "minimax_m3_sparse")
MLP_TYPES = ("dense", "sparse")
# Where each step's token positions are kept for the sparse layers (computed once per step).
POSITIONS_KEY = "msa_positions"


def _swiglu_oai(cfg: Any) -> ExpertActivation:
    return ExpertActivation("swigluoai", alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


class SwigluOAIMLP(nn.Module):
    """Dense MLP (and the shared expert): ``gate_up_proj`` stored fused (gate rows first)."""

    def __init__(self, ctx: ModelContext, hidden_size: int, intermediate_size: int,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = ReplicatedLinear(ctx, hidden_size, 2 * intermediate_size,
                                             f"{prefix}.gate_up_proj")
        self.down_proj = ReplicatedLinear(ctx, intermediate_size, hidden_size,
                                          f"{prefix}.down_proj")
        self.activation = _swiglu_oai(ctx.hf_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.activation))


class MiniMaxM3MoeBlock(SparseMoeBlock):
    """Sigmoid-routed SwiGLU-OAI experts (bias on the gate) plus one SwiGLU-OAI shared expert."""

    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        cfg = ctx.hf_config
        router = RouterSpec(cfg.num_local_experts, cfg.num_experts_per_tok, "sigmoid",
                            renormalize=True, routed_scaling_factor=cfg.routed_scaling_factor)
        super().__init__(ctx, cfg.hidden_size, cfg.intermediate_size, router, prefix,
                         correction_bias="gate", activation=_swiglu_oai(cfg),
                         expert_names=("w1", "w3", "w2"))
        self.shared_experts = SwigluOAIMLP(ctx, cfg.hidden_size, cfg.shared_intermediate_size,
                                           f"{prefix}.shared_experts")


def _offset_norm_heads_rotate_qk(attn: MiniMaxM3Attention, qkv: torch.Tensor,
                                 rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma q/k norms, then rotary."""
    t, d = qkv.shape[0], attn.head_dim
    q = attn.q_norm(qkv[:, :attn.q_size].view(t, attn.num_heads, d))
    k = attn.k_norm(qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(t, attn.num_kv_heads, d))
    return rope.rotate(q), rope.rotate(k)


def step_positions(metadata: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """``[T]`` each token's position (its sequence's last ``query_len`` positions), made once
    per step and shared by the sparse layers through ``metadata.backend_cache``."""
    cached = metadata.backend_cache.get(POSITIONS_KEY)
    if cached is None:
        cached = torch.cat([torch.arange(s - q, s) for q, s in
                            zip(metadata.query_lens_list, metadata.seq_lens_list, strict=True)]
                           ).to(device)
        metadata.backend_cache[POSITIONS_KEY] = cached
    return cached


class MiniMaxM3Attention(DecoderAttention):
    """GQA with per-head Gemma q/k norms; on ``minimax_m3_sparse`` layers, block-sparse (MSA).

    Raises:
        ValueError: an unknown ``layer_types`` entry, or an indexer whose head count is not
            the KV head count (one block selection per KV head).
    """

    def __init__(self, ctx: ModelContext, prefix: str, layer_idx: int,
                 options: DecoderOptions) -> None:
        super().__init__(ctx, prefix, layer_idx, options)
        cfg = ctx.hf_config
        kind = cfg.layer_types[layer_idx]
        if kind not in ATTENTION_TYPES:
            raise ValueError(f"{prefix}: layer type {kind!r} is not one of {ATTENTION_TYPES}")
        self.indexer: MSAIndexer | None = None
        if kind == "minimax_m3_sparse":
            if cfg.index_n_heads != self.num_kv_heads:
                raise ValueError(f"{prefix}: index_n_heads ({cfg.index_n_heads}) must equal "
                                 f"num_key_value_heads ({self.num_kv_heads})")
            rot_dim = int(self.head_dim * rope_parameters(cfg)["partial_rotary_factor"])
            self.indexer = MSAIndexer(ctx, f"{prefix}.indexer", rot_dim)

    def make_qk_norm(self, ctx: ModelContext) -> tuple[nn.Module, nn.Module]:
        eps = ctx.hf_config.rms_norm_eps
        return (OffsetRMSNorm(self.head_dim, eps, ctx.dtype),
                OffsetRMSNorm(self.head_dim, eps, ctx.dtype))

    def choose_norm_rotate_qk(self, fused_op: str) -> NormRotateQK:
        return _offset_norm_heads_rotate_qk

    def forward(self, hidden: torch.Tensor, rope: RotaryTable,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden [T, hidden]`` -> ``[T, hidden]``."""
        qkv = self.qkv_proj(hidden)
        q, k = self._norm_rotate_qk(self, qkv, rope)
        v = qkv[:, self.q_size + self.kv_size:]
        selection = None
        if self.indexer is not None:
            positions = step_positions(metadata, hidden.device)
            selection = self.indexer(hidden, positions, rope, metadata)
        if selection is None:  # dense layer, or every context within the kept blocks
            return self.o_proj(self.attn(q, k, v, metadata))
        return self.o_proj(self._attend_selected(q, k, v, selection, positions, metadata))

    def _attend_selected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         selection: torch.Tensor, positions: torch.Tensor,
                         metadata: AttentionMetadata) -> torch.Tensor:
        attn, t = self.attn, q.shape[0]
        if attn.kv_cache is None:
            raise RuntimeError(f"{attn.prefix}: no KV cache bound")
        k_cache, v_cache = attn.kv_cache
        k_scale = float(getattr(attn.backend, "k_scale", 1.0))
        v_scale = float(getattr(attn.backend, "v_scale", 1.0))
        write_kv(k_cache, v_cache, k.reshape(t, self.num_kv_heads, self.head_dim),
                 v.reshape(t, self.num_kv_heads, self.head_dim), metadata, k_scale, v_scale)
        block = self.indexer.block_size
        out = torch.empty(t, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        n = metadata.num_decodes
        if n:
            out[:n] = block_sparse_decode(q[:n], k_cache, v_cache, selection[:n],
                                          metadata.block_tables[:n], metadata.seq_lens[:n],
                                          block, attn.scale, k_scale, v_scale)
        starts = metadata.query_start_loc.tolist()
        group = self.num_heads // self.num_kv_heads
        for i in range(n, metadata.num_seqs):
            start, end, seq_len = starts[i], starts[i + 1], metadata.seq_lens_list[i]
            table = metadata.block_tables[i]
            keys = dequantize(gather_context(k_cache, table, seq_len, metadata.block_size),
                              k_scale).to(q.dtype)
            values = dequantize(gather_context(v_cache, table, seq_len, metadata.block_size),
                                v_scale).to(q.dtype)
            mask = block_sparse_mask(selection[start:end], positions[start:end], seq_len,
                                     block, group)
            out[start:end] = attend_sequence(q[start:end], keys, values, attn.scale, mask)
        return out.view(t, self.num_heads * self.head_dim)


# (pattern, replacement) from MiniMax's original checkpoint names to transformers v5's.
_ORIGINAL_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r) for p, r in (
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^language_model\.model\.", "model."),
        (r"^model\.language_model\.", "model."),  # transformers' VL wrapper
        (r"\.block_sparse_moe\.(experts|gate|shared_experts)\.", r".mlp.\1."),
        (r"\.block_sparse_moe\.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        (r"\.self_attn\.index_(q_proj|k_proj|q_norm|k_norm)\.", r".self_attn.indexer.\1."),
    ))
# Tensors of the checkpoint a text-only run does not use.
_SKIPPED = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|"
                      r"(^|\.)mtp\.")
# A dense MLP or shared expert stored as separate gate/up projections (MiniMax's names).
_SPLIT_GATE_UP = re.compile(r"^(.*(?:\.mlp|\.shared_experts))\.(gate_proj|up_proj)\.weight$")


class MiniMaxM3VLForCausalLM(DecoderForCausalLM):
    """The M3 text decoder: Gemma norms, per-layer attention and MLP kinds.

    Raises:
        ValueError: an unknown ``mlp_layer_types`` entry.
    """

    qkv_bias = False
    o_bias = False

    def __init__(self, ctx: ModelContext) -> None:
        cfg = ctx.hf_config
        for i, kind in enumerate(cfg.mlp_layer_types):
            if kind not in MLP_TYPES:
                raise ValueError(f"model.layers.{i}.mlp: mlp_layer_types entry {kind!r} is not "
                                 f"one of {MLP_TYPES}")
        super().__init__(ctx)
        self.model.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def make_layer(self, layer_idx: int) -> nn.Module:
        layer = super().make_layer(layer_idx)
        cfg = self.ctx.hf_config
        layer.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ctx.dtype)
        layer.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                       self.ctx.dtype)
        return layer

    def make_attention(self, layer_idx: int) -> nn.Module:
        return MiniMaxM3Attention(self.ctx, self.module_prefix(layer_idx, "self_attn"),
                                  layer_idx, self.options)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        prefix = self.module_prefix(layer_idx, "mlp")
        if cfg.mlp_layer_types[layer_idx] == "sparse":
            return MiniMaxM3MoeBlock(self.ctx, prefix)
        return SwigluOAIMLP(self.ctx, cfg.hidden_size, cfg.dense_intermediate_size, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load transformers' names or MiniMax's original ones (see the module docstring);
        returns every checkpoint name consumed, skipped vision/MTP tensors included."""
        skipped: set[str] = set()
        sources: dict[str, list[str]] = {}  # our name -> the checkpoint names it came from

        def translated() -> Iterator[tuple[str, torch.Tensor]]:
            halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
            for name, tensor in weights:
                if _SKIPPED.search(name):
                    skipped.add(name)
                    continue
                new = name
                for pattern, replacement in _ORIGINAL_NAMES:
                    new = pattern.sub(replacement, new)
                split = _SPLIT_GATE_UP.match(new)
                if split is None:
                    sources[new] = [name]
                    yield new, tensor
                    continue
                pair = halves.setdefault(split.group(1), {})
                pair[split.group(2)] = (name, tensor)
                if len(pair) == 2:
                    fused = f"{split.group(1)}.gate_up_proj.weight"
                    sources[fused] = [pair["gate_proj"][0], pair["up_proj"][0]]
                    yield fused, torch.cat((pair["gate_proj"][1], pair["up_proj"][1]))
            for prefix, pair in halves.items():
                if len(pair) != 2:
                    raise ValueError(f"{prefix}: the checkpoint has {next(iter(pair))} but not "
                                     f"its other half (gate_proj and up_proj are fused)")

        tied = self.lm_head.is_tied
        consumed = load_checkpoint_weights(
            self, translated(), ignore=(lambda n: n == "lm_head.weight") if tied else None)
        return {src for name in consumed for src in sources.get(name, [name])} | skipped


def _text_context(ctx: ModelContext) -> ModelContext:
    text = getattr(ctx.hf_config, "text_config", None)
    if text is None:
        raise ValueError("MiniMaxM3SparseForConditionalGeneration needs config.text_config")
    return dataclasses.replace(ctx, hf_config=text)


class MiniMaxM3SparseForConditionalGeneration(MiniMaxM3VLForCausalLM):
    """The VL checkpoint, text only: built from ``config.text_config``; the vision tower and
    projector tensors are skipped (image/video inputs are not supported)."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(_text_context(ctx))
