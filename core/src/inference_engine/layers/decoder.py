"""The Llama-family decoder shared by dense model plugins.

A model plugin subclasses :class:`DecoderForCausalLM` and sets the switches
its architecture differs by (q/k norm, qkv bias); weights load by checkpoint
name, with separate q/k/v and gate/up tensors mapped onto the fused layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import CausalLM, ModelContext
from inference_engine.layers.attention import Attention
from inference_engine.layers.embedding import LMHead, VocabEmbedding
from inference_engine.layers.linear import QKVLinear, RowLinear
from inference_engine.layers.mlp import GatedMLP
from inference_engine.layers.norm import RMSNorm
from inference_engine.layers.rotary import RotaryEmbedding, rope_parameters

__all__ = ["DecoderForCausalLM", "DecoderLayer", "SelfAttention", "load_named_weights"]

# Checkpoint projection name -> (fused module name, shard).
FUSED_NAMES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class SelfAttention(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str, qk_norm: bool, qkv_bias: bool,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVLinear(ctx, hidden, self.num_heads, self.num_kv_heads, self.head_dim,
                                  f"{prefix}.qkv_proj", bias=qkv_bias)
        self.o_proj = RowLinear(ctx, self.q_size, hidden, f"{prefix}.o_proj",
                                bias=bool(getattr(cfg, "attention_bias", False)) and not qkv_bias)
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, ctx.dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, ctx.dtype) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(ctx, self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim**-0.5, f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.view(t, self.num_kv_heads, self.head_dim), metadata)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str, qk_norm: bool, qkv_bias: bool,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = SelfAttention(ctx, f"{prefix}.self_attn", qk_norm, qkv_bias, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.mlp = GatedMLP(ctx, cfg.hidden_size, cfg.intermediate_size, f"{prefix}.mlp",
                            getattr(cfg, "hidden_act", "silu"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class _Backbone(nn.Module):
    def __init__(self, ctx: ModelContext, qk_norm: bool, qkv_bias: bool) -> None:
        super().__init__()
        cfg = ctx.hf_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(head_dim, cfg.max_position_embeddings, rope_parameters(cfg),
                                 ctx.dtype)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(ctx, f"model.layers.{i}", qk_norm, qkv_bias, rotary)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)


class DecoderForCausalLM(CausalLM):
    """Llama-shaped decoder-only model; subclasses set the architecture switches."""

    # Per-head RMSNorm on q and k before rotary (Qwen3).
    qk_norm: bool = False
    # Bias on the q/k/v projections (Qwen2).
    qkv_bias: bool = False

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.model = _Backbone(ctx, self.qk_norm, self.qkv_bias)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                              tied_to=self.model.embed_tokens if tied else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, skip_lm_head=self.lm_head.tied)


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       skip_lm_head: bool = False) -> set[str]:
    """Load checkpoint tensors onto ``model``'s (fused) parameters by name.

    Raises:
        ValueError: listing unexpected checkpoint tensors, parameters the
            checkpoint did not provide, or a shape mismatch by name.
    """
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    consumed: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (skip_lm_head and name == "lm_head.weight"):
            consumed.add(name)
            continue
        target, shard = name, None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in FUSED_NAMES:
            fused, shard = FUSED_NAMES[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            try:
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name}: {exc}") from exc
        else:
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint has {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
        loaded.add((target, shard))
        consumed.add(name)
    if unexpected:
        raise ValueError(f"unexpected tensors in the checkpoint: {sorted(unexpected)}")
    missing = []
    modules = dict(model.named_modules())
    for pname in params:
        owner = modules.get(pname.rpartition(".")[0])
        fused_shards = getattr(owner, "_shards", {})
        shards = list(fused_shards) if len(fused_shards) > 1 else [None]
        for shard in shards:
            if (pname, shard) not in loaded:
                missing.append(_checkpoint_name(pname, shard))
    if missing:
        raise ValueError(f"tensors missing from the checkpoint: {sorted(missing)}")
    return consumed


def _checkpoint_name(param_name: str, shard: object) -> str:
    if shard is None:
        return param_name
    for ckpt, (fused, s) in FUSED_NAMES.items():
        if s == shard and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{ckpt}.")
    return param_name
