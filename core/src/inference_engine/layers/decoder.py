"""The Llama-family dense decoder that model plugins specialise by overriding small methods.

What every architecture here shares lives in this file: the embedding, fused
q/k/v and gate/up matmuls, rotary (one table for all layers), paged attention
through :class:`~inference_engine.layers.attention.Attention`, sliding-window
layers from ``config.layer_types``, pre-norm residual blocks, the LM head (tied
or not) and checkpoint name mapping. An architecture subclasses
:class:`DecoderForCausalLM` and overrides what differs, each a named method:

- ``make_attention(layer_idx)`` / ``make_mlp(layer_idx)``: a layer's modules (a
  :class:`DecoderAttention` subclass, MLA, a MoE block);
- on a :class:`DecoderAttention` subclass: ``make_qk_norm`` and
  ``choose_norm_rotate_qk`` (the q/k norm path), ``make_sinks``, ``softmax_scale``;
- ``embed(input_ids)``, ``residual_scale``, ``compute_logits(hidden)``.

Per-head q/k norm (Qwen3, ``qk_norm = True``) is here because several families
share it; other q/k norms, sinks and scalings live in their model's file. The
module tree mirrors transformers' names (``model.layers.N.self_attn...``) so
checkpoint names map onto parameters directly, fused layers aside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inference_engine.distributed.parallel_state import parallel_state
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import CausalLM, ModelContext
from inference_engine.layers.attention import Attention
from inference_engine.layers.cpu_decode_step import CpuDecodeStep, build_decode_step
from inference_engine.layers.cpu_fused import fused_rms_norm
from inference_engine.layers.embedding import LMHead, VocabEmbedding
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import QKVParallelLinear, RowLinear
from inference_engine.layers.mlp import GatedMLP
from inference_engine.layers.norm import RMSNorm, rms_normalize
from inference_engine.layers.rotary import RotaryEmbedding, RotaryTable, rope_parameters
from inference_engine.layers.weights import load_checkpoint_weights

__all__ = ["DecoderAttention", "DecoderForCausalLM", "DecoderLayer", "DecoderModel",
           "DecoderOptions", "NormRotateQK", "QKNormAttention", "head_dim_of"]


def head_dim_of(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when unset."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True, slots=True)
class DecoderOptions:
    """The biases of one model's projections, resolved against its config."""

    # Biases on the q/k/v projections, on o_proj, and on the dense MLP's projections.
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def resolve(cls, config: Any, qkv_bias: bool | None, o_bias: bool | None) -> DecoderOptions:
        """None for an attention bias takes ``config.attention_bias``; MLP bias is
        ``config.mlp_bias``."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
                   o_bias=attention_bias if o_bias is None else o_bias,
                   mlp_bias=bool(getattr(config, "mlp_bias", False)))


# --------------------------------------------------------------------------- #
# Attention
# --------------------------------------------------------------------------- #


class DecoderAttention(nn.Module):
    """Self-attention: fused q/k/v, rotary, paged attention, o_proj; no q/k norm.

    Subclasses change one step each by overriding :meth:`make_qk_norm` with
    :meth:`choose_norm_rotate_qk`, :meth:`make_sinks` or :meth:`softmax_scale`;
    the base constructor calls them in that order.

    Args:
        ctx: the model context.
        prefix: dotted module name (``model.layers.0.self_attn``).
        layer_idx: the layer's index (``config.layer_types`` picks sliding layers).
        options: the model's biases.
    """

    def __init__(self, ctx: ModelContext, prefix: str, layer_idx: int,
                 options: DecoderOptions) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(ctx, cfg.hidden_size, self.num_heads, self.num_kv_heads,
                                          self.head_dim, f"{prefix}.qkv_proj",
                                          bias=options.qkv_bias)
        self.o_proj = RowLinear(ctx, self.q_size, cfg.hidden_size, f"{prefix}.o_proj",
                                bias=options.o_bias)
        # This rank's heads under tensor parallelism (all of them on one device).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm, self.k_norm = self.make_qk_norm(ctx) or (None, None)
        # q/k norm and rotary, chosen once for the device the model is built on.
        self.fused_op = choose_fused_op(getattr(ctx, "device", None))
        self._norm_rotate_qk = self.choose_norm_rotate_qk(self.fused_op)
        layer_types = getattr(cfg, "layer_types", None)
        sliding = None
        if layer_types is not None and layer_types[layer_idx] == "sliding_attention":
            sliding = getattr(cfg, "sliding_window", None)
        self.sinks = self.make_sinks(ctx)
        self.attn = Attention(ctx, self.num_heads, self.head_dim, self.num_kv_heads,
                              self.softmax_scale(cfg), f"{prefix}.attn", sliding_window=sliding,
                              sinks=self.sinks)

    def make_qk_norm(self, ctx: ModelContext) -> tuple[nn.Module, nn.Module] | None:
        """The ``(q_norm, k_norm)`` modules, or None (the default) for no q/k norm."""
        return None

    def choose_norm_rotate_qk(self, fused_op: str) -> NormRotateQK:
        """The q/k norm + rotary function this layer binds at build (see :data:`NormRotateQK`);
        ``fused_op`` is :func:`~inference_engine.layers.fused_op_choice.choose_fused_op`'s
        answer. The default rotates without a norm."""
        return _rotate_qk

    def make_sinks(self, ctx: ModelContext) -> torch.Tensor | None:
        """``[num_heads]`` attention-sink logits handed to the backend, or None (the default)."""
        return None

    def softmax_scale(self, cfg: Any) -> float:
        """The attention softmax scale: ``head_dim ** -0.5`` by default."""
        return self.head_dim**-0.5

    def process_weights_after_loading(self) -> None:
        """Nothing to prepare by default (see :class:`QKNormAttention`)."""

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


class QKNormAttention(DecoderAttention):
    """:class:`DecoderAttention` with per-head RMSNorm on q and k before rotary (Qwen3).

    One ``[head_dim]`` weight for all q heads and one for all k heads; after loading
    they are also stacked per head (``qk_norm_weight``) so the C++ norm does every
    head in one call.
    """

    # The q and k norm weights stacked per head ([heads + kv_heads, head_dim]), made
    # after loading; None until then.
    qk_norm_weight: torch.Tensor | None = None

    def make_qk_norm(self, ctx: ModelContext) -> tuple[nn.Module, nn.Module]:
        eps = ctx.hf_config.rms_norm_eps
        return RMSNorm(self.head_dim, eps, ctx.dtype), RMSNorm(self.head_dim, eps, ctx.dtype)

    def choose_norm_rotate_qk(self, fused_op: str) -> NormRotateQK:
        if fused_op == "triton":
            import inference_engine.layers.triton_fused  # noqa: F401 - fail at build, not per call

            return _norm_heads_rotate_qk_triton
        return _norm_heads_rotate_qk_cpu if fused_op == "cpu" else _norm_heads_rotate_qk_torch

    def process_weights_after_loading(self) -> None:
        """Stack the per-head q/k norm weights (see ``qk_norm_weight``)."""
        q_w, k_w = self.q_norm.weight.data, self.k_norm.weight.data
        self.qk_norm_weight = torch.cat((q_w.expand(self.num_heads, -1),
                                         k_w.expand(self.num_kv_heads, -1))).contiguous()


def _norm_heads_torch(attn: QKNormAttention, qk: torch.Tensor) -> torch.Tensor:
    qk = rms_normalize(qk, attn.q_norm.eps)
    qk[:, :attn.num_heads].mul_(attn.q_norm.weight)
    qk[:, attn.num_heads:].mul_(attn.k_norm.weight)
    return qk


def _norm_heads_rotate_qk_torch(attn: QKNormAttention, qkv: torch.Tensor,
                                rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k norm by torch ops, then rotary."""
    return _split_rotate(attn, _norm_heads_torch(attn, _qk_heads(attn, qkv)), rope)


def _norm_heads_rotate_qk_cpu(attn: QKNormAttention, qkv: torch.Tensor,
                              rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k norm by the C++ kernel with the stacked weights where it applies."""
    qk = _qk_heads(attn, qkv)
    fused = (fused_rms_norm(qk, attn.qk_norm_weight, attn.q_norm.eps)
             if attn.qk_norm_weight is not None else None)
    qk = fused[0] if fused is not None else _norm_heads_torch(attn, qk)
    return _split_rotate(attn, qk, rope)


def _norm_heads_rotate_qk_triton(attn: QKNormAttention, qkv: torch.Tensor,
                                 rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k norm and rotary in one Triton launch."""
    from inference_engine.layers.triton_fused import qk_norm_rotary

    t, d = qkv.shape[0], attn.head_dim
    q = qkv[:, :attn.q_size].view(t, attn.num_heads, d)
    k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(t, attn.num_kv_heads, d)
    return qk_norm_rotary(rope, q, k, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)


# --------------------------------------------------------------------------- #
# Layers and model
# --------------------------------------------------------------------------- #


class DecoderLayer(nn.Module):
    """Pre-norm block: attention and MLP, each with a residual add fused into the next norm.

    Args:
        ctx: the model context.
        self_attn: ``forward(hidden, rope, metadata) -> [T, hidden]``.
        mlp: ``forward(hidden) -> [T, hidden]``, registered as ``mlp_name``.
        mlp_name: the MLP's module name in checkpoints (``mlp``, ``block_sparse_moe``).
        residual_scale: multiplies each branch's output before its residual add (Granite).
    """

    def __init__(self, ctx: ModelContext, self_attn: nn.Module, mlp: nn.Module,
                 mlp_name: str = "mlp", residual_scale: float = 1.0) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.residual_scale = residual_scale

    def cpu_decode_blocker(self) -> str | None:
        """Why this layer is not the plain block :mod:`~inference_engine.layers.cpu_decode_step`
        runs in C++ (None when it is): exactly this class with no residual scale, the shared
        attention with the CPU q/k kernels, the gated SiLU MLP and RMSNorms on the CPU kernels."""
        if type(self) is not DecoderLayer or self.residual_scale != 1.0:
            return "not the plain pre-norm decoder layer"
        if parallel_state().tp.size > 1:
            return "tensor parallelism (the all-reduces run between the C++ layers)"
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            if type(norm) is not RMSNorm or norm.fused_op != "cpu":
                return "its norms are not the CPU RMSNorm"
        attn = self.self_attn
        if type(attn) not in (DecoderAttention, QKNormAttention):
            return f"attention {type(attn).__name__} is not the shared decoder's"
        if attn._norm_rotate_qk not in (_rotate_qk, _norm_heads_rotate_qk_cpu):
            return "q/k norm and rotary are not the CPU kernels"
        mlp = self._modules[self.mlp_name]
        if type(mlp) is not GatedMLP or mlp.fused_op != "cpu":
            return "the MLP is not the gated SiLU MLP on the CPU kernel"
        return None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryTable,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, metadata)
        if self.residual_scale != 1.0:
            hidden = hidden * self.residual_scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self._modules[self.mlp_name](hidden)
        if self.residual_scale != 1.0:
            hidden = hidden * self.residual_scale
        return hidden, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of checkpoints).

    Args:
        ctx: the model context.
        make_layer: builds layer ``i`` (called in order, after the embedding).
    """

    def __init__(self, ctx: ModelContext, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        # One table for all layers (they share the config's rope settings).
        self.rotary_emb = RotaryEmbedding(head_dim_of(cfg), cfg.max_position_embeddings,
                                          rope_parameters(cfg), ctx.dtype,
                                          min_positions=ctx.max_model_len)
        # The layers of a pure-decode step in one C++ call, bound with the KV cache
        # (kv_cache_bound); None: layer by layer.
        self.decode_step: CpuDecodeStep | None = None

    def kv_cache_bound(self) -> None:
        """Bind (or drop, without a cache) the C++ decode step for the current caches."""
        self.decode_step = build_decode_step(self)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Embedded tokens ``[T, hidden]``, ``positions [T]`` -> final-normed ``[T, hidden]``."""
        rope = self.rotary_emb.lookup(positions)
        step = self.decode_step
        if step is not None and step.applies(hidden, metadata):
            hidden, residual = step.run(hidden, rope, metadata)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, rope, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(CausalLM):
    """Llama-shaped decoder-only model; subclasses override the methods that differ.

    Build with ``cls(ctx)`` for a :class:`~inference_engine.interfaces.model.ModelContext`;
    load with :meth:`load_weights`; the runner binds each
    :class:`~inference_engine.layers.attention.Attention`'s ``kv_cache``.
    """

    # Per-head RMSNorm on q and k before rotary (Qwen3): QKNormAttention.
    qk_norm: bool = False
    # Bias on the q/k/v projections; None reads config.attention_bias (Llama, Qwen3).
    qkv_bias: bool | None = None
    # Bias on o_proj; None reads config.attention_bias.
    o_bias: bool | None = None
    # The MLP's module name in checkpoints ("mlp"; Mixtral-style "block_sparse_moe").
    mlp_name: str = "mlp"
    # Multiplies each residual branch's output (Granite's residual_multiplier).
    residual_scale: float = 1.0
    # (checkpoint substring, our substring) pairs applied to every checkpoint name.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.options = DecoderOptions.resolve(cfg, self.qkv_bias, self.o_bias)
        self.model = DecoderModel(ctx, self.make_layer)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                              tied_to=self.model.embed_tokens if tied else None)

    # ---- what a layer is made of ------------------------------------------------ #

    def module_prefix(self, layer_idx: int, name: str) -> str:
        """The dotted name of layer ``layer_idx``'s module ``name`` (``model.layers.0.mlp``)."""
        return f"model.layers.{layer_idx}.{name}"

    def make_layer(self, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``: :meth:`make_attention` and :meth:`make_mlp` in a pre-norm block."""
        return DecoderLayer(self.ctx, self.make_attention(layer_idx), self.make_mlp(layer_idx),
                            self.mlp_name, self.residual_scale)

    def make_attention(self, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s attention, ``forward(hidden, rope, metadata)``: a
        :class:`DecoderAttention` (:class:`QKNormAttention` when ``qk_norm``)."""
        cls = QKNormAttention if self.qk_norm else DecoderAttention
        return cls(self.ctx, self.module_prefix(layer_idx, "self_attn"), layer_idx, self.options)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s MLP: the dense :class:`GatedMLP`."""
        cfg = self.ctx.hf_config
        return GatedMLP(self.ctx, cfg.hidden_size, cfg.intermediate_size,
                        self.module_prefix(layer_idx, self.mlp_name),
                        getattr(cfg, "hidden_act", "silu"), bias=self.options.mlp_bias)

    # ---- the forward pass ------------------------------------------------------- #

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` -> ``[T, hidden]``, the first layer's input."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(self.embed(input_ids), positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def override_blocker(self) -> str | None:
        """Which of the shared decoder's forward pieces this model replaces (a greedy window
        runs the shared ones in C++, so it cannot run a model that replaces any), or None."""
        cls = type(self)
        for name in ("forward", "embed", "compute_logits"):
            if getattr(cls, name) is not getattr(DecoderForCausalLM, name):
                return f"{cls.__name__} overrides {name}"
        if type(self.model).forward is not DecoderModel.forward:
            return f"{type(self.model).__name__} overrides forward"
        return None

    def kv_cache_bound(self) -> None:
        self.model.kv_cache_bound()
        from inference_engine.layers.cpu_greedy_window import build_greedy_window

        self.greedy_window = build_greedy_window(self)

    # ---- loading ---------------------------------------------------------------- #

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
