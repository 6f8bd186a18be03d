"""The Llama-family dense decoder that model plugins specialise.

A plugin subclasses :class:`DecoderForCausalLM` and sets the few switches its
architecture differs by (per-head q/k norm, q/k/v bias, o bias); everything
else (fused q/k/v and gate/up matmuls, rotary scaling, sliding-window layers
from ``config.layer_types``, tied embeddings, checkpoint name mapping) is here.
The module tree mirrors transformers' names (``model.layers.N.self_attn...``)
so checkpoint names map onto parameters directly, fused layers aside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import CausalLM, ModelContext
from inference_engine.layers.attention import Attention
from inference_engine.layers.cpu_fused import fused_rms_norm
from inference_engine.layers.embedding import LMHead, VocabEmbedding
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import QKVParallelLinear, RowLinear
from inference_engine.layers.mlp import GatedMLP
from inference_engine.layers.norm import RMSNorm, rms_normalize
from inference_engine.layers.rotary import RotaryEmbedding, RotaryTable, rope_parameters
from inference_engine.layers.weights import load_checkpoint_weights

__all__ = ["DecoderAttention", "DecoderForCausalLM", "DecoderLayer", "DecoderModel",
           "DecoderOptions", "head_dim_of"]


def head_dim_of(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when unset."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True, slots=True)
class DecoderOptions:
    """The per-architecture switches, resolved against one config."""

    # Per-head RMSNorm on q and k before rotary (Qwen3).
    qk_norm: bool
    # Biases on the q/k/v projections, on o_proj, and on the MLP's projections.
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # q/k norm per head ("head") or over all heads at once ("all_heads", MiniMax-M2).
    qk_norm_scope: str = "head"
    # A learned per-head attention-sink logit (``self_attn.sinks``, gpt-oss).
    attention_sinks: bool = False
    # Builds layer i's attention (MLA); None or a None result: DecoderAttention.
    make_attention: Callable[[ModelContext, str, int], nn.Module | None] | None = None
    # Builds layer i's MLP (MoE blocks); None or a None result: the dense GatedMLP.
    make_mlp: Callable[[ModelContext, str, int], nn.Module | None] | None = None
    # The MLP's module name in checkpoints ("mlp"; Mixtral-style "block_sparse_moe").
    mlp_name: str = "mlp"
    # Granite's scalings (1.0 / None elsewhere): embeddings, each residual branch,
    # the attention softmax scale (None: head_dim ** -0.5) and the logits divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    @classmethod
    def resolve(cls, config: Any, qk_norm: bool, qkv_bias: bool | None,
                o_bias: bool | None, **extra: Any) -> DecoderOptions:
        """None for a bias takes ``config.attention_bias``; MLP bias is ``config.mlp_bias``.

        Granite's multipliers are read from the config when it has them.
        """
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            qk_norm=qk_norm,
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            embedding_multiplier=float(getattr(config, "embedding_multiplier", None) or 1.0),
            residual_multiplier=float(getattr(config, "residual_multiplier", None) or 1.0),
            attention_multiplier=getattr(config, "attention_multiplier", None),
            logits_scaling=float(getattr(config, "logits_scaling", None) or 1.0),
            **extra,
        )


class DecoderAttention(nn.Module):
    """Self-attention: fused q/k/v, optional q/k norm, rotary, paged attention, o_proj."""

    def __init__(self, ctx: ModelContext, prefix: str, layer_idx: int,
                 opts: DecoderOptions) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(ctx, cfg.hidden_size, self.num_heads, self.num_kv_heads,
                                          self.head_dim, f"{prefix}.qkv_proj", bias=opts.qkv_bias)
        self.o_proj = RowLinear(ctx, self.q_size, cfg.hidden_size, f"{prefix}.o_proj",
                                bias=opts.o_bias)
        self.qk_norm_per_head = opts.qk_norm_scope == "head"
        if opts.qk_norm:
            q_width, k_width = ((self.head_dim, self.head_dim) if self.qk_norm_per_head
                                else (self.q_size, self.kv_size))
            self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, ctx.dtype)
            self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, ctx.dtype)
        else:
            self.q_norm = self.k_norm = None
        # Per-head q/k norm weights stacked per head ([heads + kv_heads, head_dim]),
        # made after loading, so the fused CPU norm does all heads in one call.
        self.qk_norm_weight: torch.Tensor | None = None
        # q/k norm and rotary, chosen once for the device the model is built on.
        self.fused_op = choose_fused_op(getattr(ctx, "device", None))
        self._norm_rotate_qk = _norm_rotate_qk_impl(opts.qk_norm, self.qk_norm_per_head,
                                                    self.fused_op)
        layer_types = getattr(cfg, "layer_types", None)
        sliding = None
        if layer_types is not None and layer_types[layer_idx] == "sliding_attention":
            sliding = getattr(cfg, "sliding_window", None)
        scale = opts.attention_multiplier or self.head_dim**-0.5
        self.sinks = (nn.Parameter(torch.empty(self.num_heads, dtype=ctx.dtype),
                                   requires_grad=False) if opts.attention_sinks else None)
        self.attn = Attention(ctx, self.num_heads, self.head_dim, self.num_kv_heads,
                              scale, f"{prefix}.attn", sliding_window=sliding, sinks=self.sinks)

    def process_weights_after_loading(self) -> None:
        """Stack the per-head q/k norm weights (see ``qk_norm_weight``)."""
        if self.q_norm is None or not self.qk_norm_per_head:
            return
        q_w, k_w = self.q_norm.weight.data, self.k_norm.weight.data
        self.qk_norm_weight = torch.cat((q_w.expand(self.num_heads, -1),
                                         k_w.expand(self.num_kv_heads, -1))).contiguous()

    def forward(self, hidden: torch.Tensor, rope: RotaryTable,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden [T, hidden]`` -> ``[T, hidden]``."""
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k = self._norm_rotate_qk(self, qkv, rope)  # [T, heads, D], [T, kv_heads, D]
        out = self.attn(q, k, qkv[:, self.q_size + self.kv_size:], metadata)  # [T, h * D]
        return self.o_proj(out)


# The q/k part of DecoderAttention.forward: (layer, qkv [T, q + 2 kv], rope) -> (q, k) as
# [T, heads, D] and [T, kv_heads, D]. q and k are adjacent columns of qkv, so each variant
# normalises and rotates all their heads together.
NormRotateQK = Callable[[DecoderAttention, torch.Tensor, RotaryTable],
                        tuple[torch.Tensor, torch.Tensor]]


def _qk_heads(attn: DecoderAttention, qkv: torch.Tensor) -> torch.Tensor:
    # [T, heads + kv_heads, D]: a view of qkv's q and k columns.
    return qkv[:, :attn.q_size + attn.kv_size].view(qkv.shape[0], -1, attn.head_dim)


def _split_rotate(attn: DecoderAttention, qk: torch.Tensor,
                  rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = rope.rotate(qk).split([attn.num_heads, attn.num_kv_heads], dim=1)
    return q, k


def _rotate_qk(attn: DecoderAttention, qkv: torch.Tensor,
               rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """No q/k norm: rotate the q and k heads in one pass."""
    return _split_rotate(attn, _qk_heads(attn, qkv), rope)


def _norm_all_heads_rotate_qk(attn: DecoderAttention, qkv: torch.Tensor,
                              rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """q norm over all q heads at once, k norm likewise (MiniMax-M2), then rotary."""
    q_normed = attn.q_norm(qkv[:, :attn.q_size])
    k_normed = attn.k_norm(qkv[:, attn.q_size:attn.q_size + attn.kv_size])
    qk = torch.cat((q_normed, k_normed), dim=1).view(qkv.shape[0], -1, attn.head_dim)
    return _split_rotate(attn, qk, rope)


def _norm_heads_torch(attn: DecoderAttention, qk: torch.Tensor) -> torch.Tensor:
    qk = rms_normalize(qk, attn.q_norm.eps)
    qk[:, :attn.num_heads].mul_(attn.q_norm.weight)
    qk[:, attn.num_heads:].mul_(attn.k_norm.weight)
    return qk


def _norm_heads_rotate_qk_torch(attn: DecoderAttention, qkv: torch.Tensor,
                                rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k norm (Qwen3) by torch ops, then rotary."""
    return _split_rotate(attn, _norm_heads_torch(attn, _qk_heads(attn, qkv)), rope)


def _norm_heads_rotate_qk_cpu(attn: DecoderAttention, qkv: torch.Tensor,
                              rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k norm by the C++ kernel with the stacked weights where it applies."""
    qk = _qk_heads(attn, qkv)
    fused = (fused_rms_norm(qk, attn.qk_norm_weight, attn.q_norm.eps)
             if attn.qk_norm_weight is not None else None)
    qk = fused[0] if fused is not None else _norm_heads_torch(attn, qk)
    return _split_rotate(attn, qk, rope)


def _norm_heads_rotate_qk_triton(attn: DecoderAttention, qkv: torch.Tensor,
                                 rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k norm and rotary in one Triton launch."""
    from inference_engine.layers.triton_fused import qk_norm_rotary

    t, d = qkv.shape[0], attn.head_dim
    q = qkv[:, :attn.q_size].view(t, attn.num_heads, d)
    k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(t, attn.num_kv_heads, d)
    return qk_norm_rotary(rope, q, k, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)


def _norm_rotate_qk_impl(qk_norm: bool, per_head: bool, fused_op: str) -> NormRotateQK:
    """The q/k norm + rotary variant of a layer (its rotary kernel is the table's own)."""
    if not qk_norm:
        return _rotate_qk
    if not per_head:
        return _norm_all_heads_rotate_qk
    if fused_op == "triton":
        import inference_engine.layers.triton_fused  # noqa: F401 - fail at build, not per call

        return _norm_heads_rotate_qk_triton
    return _norm_heads_rotate_qk_cpu if fused_op == "cpu" else _norm_heads_rotate_qk_torch


class DecoderLayer(nn.Module):
    """Pre-norm block: attention and MLP, each with a residual add fused into the next norm."""

    def __init__(self, ctx: ModelContext, prefix: str, layer_idx: int,
                 opts: DecoderOptions) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        attn = (opts.make_attention(ctx, f"{prefix}.self_attn", layer_idx)
                if opts.make_attention is not None else None)
        self.self_attn = attn or DecoderAttention(ctx, f"{prefix}.self_attn", layer_idx, opts)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.residual_multiplier = opts.residual_multiplier
        self.mlp_name = opts.mlp_name
        mlp_prefix = f"{prefix}.{opts.mlp_name}"
        mlp = opts.make_mlp(ctx, mlp_prefix, layer_idx) if opts.make_mlp is not None else None
        if mlp is None:
            mlp = GatedMLP(ctx, cfg.hidden_size, cfg.intermediate_size, mlp_prefix,
                           getattr(cfg, "hidden_act", "silu"), bias=opts.mlp_bias)
        self.add_module(opts.mlp_name, mlp)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryTable,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, metadata)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self._modules[self.mlp_name](hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of checkpoints)."""

    def __init__(self, ctx: ModelContext, opts: DecoderOptions, prefix: str = "model") -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(ctx, f"{prefix}.layers.{i}", i, opts) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.embedding_multiplier = opts.embedding_multiplier
        # One table for all layers (they share the config's rope settings).
        self.rotary_emb = RotaryEmbedding(head_dim_of(cfg), cfg.max_position_embeddings,
                                          rope_parameters(cfg), ctx.dtype,
                                          min_positions=ctx.max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """``input_ids, positions [T]`` -> final-normed hidden states ``[T, hidden]``."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        rope = self.rotary_emb.lookup(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(CausalLM):
    """Llama-shaped decoder-only model; subclasses set the architecture switches.

    Build with ``cls(ctx)`` for a :class:`~inference_engine.interfaces.model.ModelContext`;
    load with :meth:`load_weights`; the runner binds each
    :class:`~inference_engine.layers.attention.Attention`'s ``kv_cache``.
    """

    # Per-head RMSNorm on q and k before rotary (Qwen3).
    qk_norm: bool = False
    # Bias on the q/k/v projections; None reads config.attention_bias (Llama, Qwen3).
    qkv_bias: bool | None = None
    # Bias on o_proj; None reads config.attention_bias.
    o_bias: bool | None = None
    # q/k norm per head ("head") or over all heads at once ("all_heads").
    qk_norm_scope: str = "head"
    # A learned per-head attention-sink logit per layer (gpt-oss).
    attention_sinks: bool = False
    # The MLP's module name in checkpoints ("mlp"; Mixtral-style "block_sparse_moe").
    mlp_name: str = "mlp"
    # (checkpoint substring, our substring) pairs applied to every checkpoint name.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def make_mlp(self, ctx: ModelContext, prefix: str, layer_idx: int) -> nn.Module | None:
        """Layer ``layer_idx``'s MLP; None (the default) builds the dense :class:`GatedMLP`."""
        return None

    def make_attention(self, ctx: ModelContext, prefix: str, layer_idx: int) -> nn.Module | None:
        """Layer ``layer_idx``'s attention, ``forward(hidden, rope, metadata)``; None (the
        default) builds :class:`DecoderAttention`."""
        return None

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        opts = DecoderOptions.resolve(cfg, self.qk_norm, self.qkv_bias, self.o_bias,
                                      qk_norm_scope=self.qk_norm_scope,
                                      attention_sinks=self.attention_sinks, make_mlp=self.make_mlp,
                                      make_attention=self.make_attention,
                                      mlp_name=self.mlp_name)
        self.logits_scaling = opts.logits_scaling
        self.model = DecoderModel(ctx, opts)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                              tied_to=self.model.embed_tokens if tied else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load by checkpoint name (``q_proj``... onto fused layers).

        A tied model skips ``lm_head.weight`` if the checkpoint has one.

        Raises:
            ValueError: listing unexpected tensors, shape mismatches and
                missing tensors by checkpoint name.
        """
        tied = self.lm_head.is_tied
        original: dict[str, str] = {}  # renamed -> checkpoint name, to report what was consumed
        if self.checkpoint_renames:
            weights = ((self._rename(name, original), tensor) for name, tensor in weights)
        consumed = load_checkpoint_weights(
            self, weights, ignore=(lambda name: name == "lm_head.weight") if tied else None
        )
        return {original.get(name, name) for name in consumed}

    def _rename(self, name: str, original: dict[str, str]) -> str:
        renamed = name
        for old, new in self.checkpoint_renames:
            renamed = renamed.replace(old, new)
        if renamed != name:
            original[renamed] = name
        return renamed
