"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion``): block diffusion on Gemma-4 layers.

Two stacks share every text weight (layers, final norm, embeddings, tied LM head):

- the causal **encoder** is :meth:`forward`: ordinary prefill chunks over the prompt
  and each committed block, writing the paged KV cache (the only writer);
- the **decoder** is :meth:`denoise`: one pass over a canvas of ``canvas_length``
  tokens per request at positions ``[L, L + C)``, attending the cached prefix
  (read-only) plus the canvas non-causally (``AttentionBackend.forward_prefix_block``);
  it adds self-conditioning (probability-weighted embeddings through a gated MLP).

Gemma-4 layers: sliding and full attention (full layers have their own head size and
KV heads, and no ``v_proj``: V is the RMS-normed ``k_proj`` output), q/k RMSNorm,
attention scale 1.0, proportional partial RoPE on full layers, a dense gated-GELU MLP
plus a softmax-routed MoE summed in every layer, a per-layer scalar, logits
soft-capped at 30. Text only: the vision tower's tensors are skipped and image
inputs are refused (their token id in a prompt is an error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.block_diffusion import BlockDiffusionLM
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import Attention, ReplicatedLinear, load_checkpoint_weights
from inference_engine.layers.moe import GELU_TANH, FusedMoE
from torch import nn

__all__ = ["DiffusionGemmaForBlockDiffusion"]

# transformers' class constant (not a config field).
FINAL_LOGIT_SOFTCAP = 30.0


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma-4 RMSNorm in float32: ``x / rms(x) * weight`` (no ``1 + w``)."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, with_scale: bool = True,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = (nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
                       if with_scale else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


def _inv_freq(params: dict[str, Any], head_dim: int, layer_type: str) -> torch.Tensor:
    """``[head_dim / 2]`` inverse frequencies; proportional RoPE pads zeros (unrotated)."""
    rope_type = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    partial = float(params.get("partial_rotary_factor", 1.0))
    if rope_type == "proportional":
        angles = int(partial * head_dim // 2)
        rotated = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float()
                                  / head_dim)
        inv = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
        return inv / float(params.get("factor", 1.0))
    if rope_type == "default" and partial == 1.0:
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    raise ValueError(f"DiffusionGemma {layer_type} layers: rope_type {rope_type!r} with "
                     f"partial_rotary_factor {partial} is not supported (default or proportional)")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE: ``x [T, heads, d]``, ``cos``/``sin [T, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _layer_overrides(config: Any, layer_idx: int) -> dict[str, Any]:
    """The layer's head_dim / num_key_value_heads: transformers' per-layer view of the config,
    or the raw ``per_layer_config`` dict of config.json (keys are strings there)."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is None or isinstance(per_layer, dict):
        base = {"head_dim": config.head_dim, "num_key_value_heads": config.num_key_value_heads}
        per_layer = per_layer or {}
        return base | dict(per_layer.get(str(layer_idx), per_layer.get(layer_idx)) or {})
    view = per_layer[layer_idx]
    return {k: getattr(view, k) for k in ("head_dim", "num_key_value_heads")}


class DiffusionGemmaAttention(nn.Module):
    """One Gemma-4 attention layer, shared by the encoder (causal, writes the cache) and
    the decoder (prefix + canvas, writes nothing)."""

    def __init__(self, ctx: ModelContext, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        layer_type = config.layer_types[layer_idx]
        self.is_sliding = layer_type == "sliding_attention"
        overrides = _layer_overrides(config, layer_idx)
        self.head_dim = int(overrides["head_dim"])
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = int(overrides["num_key_value_heads"])
        hidden, bias = config.hidden_size, bool(config.attention_bias)
        self.q_proj = ReplicatedLinear(ctx, hidden, self.num_heads * self.head_dim,
                                       f"{prefix}.q_proj", bias)
        self.k_proj = ReplicatedLinear(ctx, hidden, self.num_kv_heads * self.head_dim,
                                       f"{prefix}.k_proj", bias)
        # Full layers have K = V: no v_proj, V is the normed k_proj output.
        self.v_proj = (ReplicatedLinear(ctx, hidden, self.num_kv_heads * self.head_dim,
                                        f"{prefix}.v_proj", bias) if self.is_sliding else None)
        self.o_proj = ReplicatedLinear(ctx, self.num_heads * self.head_dim, hidden,
                                       f"{prefix}.o_proj", bias)
        eps = config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(self.head_dim, eps, dtype=ctx.dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps, dtype=ctx.dtype)
        self.eps = eps
        window = config.sliding_window if self.is_sliding else None
        self.attn = Attention(ctx, self.num_heads, self.head_dim, self.num_kv_heads, 1.0,
                              f"{prefix}.attn", sliding_window=window)
        self.register_buffer("inv_freq", _inv_freq(config.rope_parameters[layer_type],
                                                   self.head_dim, layer_type), persistent=False)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        freqs = positions.float().unsqueeze(1) * self.inv_freq.float().unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        q = _rotate(q, cos, sin)
        k_raw = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(
            t, self.num_kv_heads, self.head_dim)
        k = _rotate(self.k_norm(k_raw), cos, sin)
        v = _rms(v_raw, None, self.eps)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata, is_block: bool = False) -> torch.Tensor:
        q, k, v = self._qkv(x, positions)
        if not is_block:
            out = self.attn(q, k, v, metadata)
        else:
            if self.attn.kv_cache is None:
                raise RuntimeError(f"{self.attn.prefix}: no KV cache bound")
            out = self.attn.backend.forward_prefix_block(
                q.contiguous(), k.contiguous(), v.contiguous(), self.attn.kv_cache, metadata)
        return self.o_proj(out)


class GatedGeluMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` (the dense MLP and the self-conditioning MLP)."""

    def __init__(self, ctx: ModelContext, hidden: int, intermediate: int, prefix: str) -> None:
        super().__init__()
        self.gate_proj = ReplicatedLinear(ctx, hidden, intermediate, f"{prefix}.gate_proj")
        self.up_proj = ReplicatedLinear(ctx, hidden, intermediate, f"{prefix}.up_proj")
        self.down_proj = ReplicatedLinear(ctx, intermediate, hidden, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaRouter(nn.Module):
    """Softmax over experts of the scaled, RMS-normed input; top-k renormalised, times a
    learned per-expert scale."""

    def __init__(self, ctx: ModelContext, config: Any, prefix: str) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        self.top_k = config.top_k_experts
        self.eps = config.rms_norm_eps
        self.root = hidden ** -0.5
        self.proj = ReplicatedLinear(ctx, hidden, experts, f"{prefix}.proj")
        self.scale = nn.Parameter(torch.ones(hidden, dtype=ctx.dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(experts, dtype=ctx.dtype),
                                             requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _rms(x, None, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class DiffusionGemmaLayer(nn.Module):
    def __init__(self, ctx: ModelContext, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DiffusionGemmaAttention(ctx, config, layer_idx, f"{prefix}.self_attn")
        self.mlp = GatedGeluMLP(ctx, hidden, config.intermediate_size, f"{prefix}.mlp")
        self.router = GemmaRouter(ctx, config, f"{prefix}.router")
        self.experts = FusedMoE(ctx, config.num_experts, hidden, config.moe_intermediate_size,
                                f"{prefix}.experts", activation=GELU_TANH)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            setattr(self, name, GemmaRMSNorm(hidden, eps, dtype=ctx.dtype))
        # The decoder's scalar (checkpoint ``model.decoder.layers.N.layer_scalar``) and the
        # encoder's (``model.encoder.language_model.layers.N.layer_scalar``): buffers in
        # transformers, so not tied; kept apart.
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=ctx.dtype), requires_grad=False)
        self.encoder_layer_scalar = nn.Parameter(torch.ones(1, dtype=ctx.dtype),
                                                 requires_grad=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                is_block: bool) -> torch.Tensor:
        residual = x
        h = self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, metadata, is_block))
        h = residual + h
        residual = h
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        weights, ids = self.router(residual)
        sparse = self.experts(self.pre_feedforward_layernorm_2(residual), weights, ids)
        h = dense + self.post_feedforward_layernorm_2(sparse)
        h = residual + self.post_feedforward_layernorm(h)
        return h * (self.layer_scalar if is_block else self.encoder_layer_scalar)


class SelfConditioning(nn.Module):
    """``post_norm(embeds + mlp(pre_norm(soft)))``: the previous step's beliefs fed back."""

    def __init__(self, ctx: ModelContext, config: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_norm = GemmaRMSNorm(hidden, eps, dtype=ctx.dtype)
        self.post_norm = GemmaRMSNorm(hidden, eps, with_scale=False)
        self.mlp = GatedGeluMLP(ctx, hidden, config.intermediate_size, "self_conditioning")

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        return self.post_norm(embeds + self.mlp(self.pre_norm(soft)))


def _text_config(hf_config: Any) -> Any:
    text = getattr(hf_config, "text_config", None)
    if text is None:
        raise ValueError("DiffusionGemmaForBlockDiffusion needs config.text_config")
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise ValueError("DiffusionGemma with use_bidirectional_attention='all' (a non-causal "
                         "encoder) is not supported")
    for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if getattr(text, name, None) is None:
            raise ValueError(f"DiffusionGemma text_config.{name} is not set (every layer has "
                             f"a MoE block)")
    return text


class DiffusionGemmaForBlockDiffusion(BlockDiffusionLM):
    """The text path of transformers' ``DiffusionGemmaForBlockDiffusion``."""

    def __init__(self, ctx: ModelContext) -> None:
        config = _text_config(ctx.hf_config)
        self.canvas_length = int(getattr(ctx.hf_config, "canvas_length", None) or 256)
        self.image_token_id = getattr(ctx.hf_config, "image_token_id", None)
        # The engine reads the text config (vocab_size, eos...) through ``ctx.hf_config``.
        ctx = dataclasses.replace(ctx, hf_config=config)
        super().__init__(ctx)
        self.config = config
        self.pad_token_id = int(config.pad_token_id or 0)
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.embed_scale = config.hidden_size ** 0.5
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=ctx.dtype),
            requires_grad=False)
        self.layers = nn.ModuleList(
            DiffusionGemmaLayer(ctx, config, i, f"layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=ctx.dtype)
        self.self_conditioning = SelfConditioning(ctx, config)

    # ---- the encoder: causal prefill chunks that write the cache ------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_tokens) * torch.tensor(
            self.embed_scale, dtype=self.embed_tokens.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        h = self._embed(input_ids)
        for layer in self.layers:
            h = layer(h, positions, metadata, is_block=False)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.embed_tokens).float()
        return torch.tanh(logits / FINAL_LOGIT_SOFTCAP) * FINAL_LOGIT_SOFTCAP

    # ---- the decoder: one denoising pass over every canvas -------------------------
    def denoise(self, canvas_ids: torch.Tensor, soft_embeddings: torch.Tensor | None,
                positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        b, c = canvas_ids.shape
        embeds = self._embed(canvas_ids.reshape(-1))
        soft = (torch.zeros_like(embeds) if soft_embeddings is None
                else soft_embeddings.reshape(b * c, -1).to(embeds.dtype))
        h = self.self_conditioning(embeds, soft)
        for layer in self.layers:
            h = layer(h, positions, metadata, is_block=True)
        return self.compute_logits(self.norm(h)).view(b, c, -1)

    def soft_embeddings(self, processed_logits: torch.Tensor) -> torch.Tensor:
        probs = processed_logits.softmax(dim=-1, dtype=torch.float32).to(self.embed_tokens.dtype)
        return torch.matmul(probs, self.embed_tokens) * torch.tensor(
            self.embed_scale, dtype=self.embed_tokens.dtype)

    # ---- weights ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped: set[str] = set()
        sources: dict[str, str] = {}

        def translated() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.",
                                    "model.vision_tower.", "model.embed_vision.")):
                    skipped.add(name)  # text only: the vision tower is not built
                    continue
                if name == "lm_head.weight":
                    skipped.add(name)  # tied to the embeddings
                    continue
                if name.startswith("model.encoder.language_model."):
                    rest = name.removeprefix("model.encoder.language_model.")
                    if rest.startswith("layers.") and rest.endswith(".layer_scalar"):
                        ours = rest.removesuffix("layer_scalar") + "encoder_layer_scalar"
                        sources[ours] = name
                        yield ours, tensor
                        continue
                    raise ValueError(f"{name}: untied encoder weights are not supported (the "
                                     f"encoder shares the decoder's text weights)")
                if not name.startswith("model.decoder."):
                    raise ValueError(f"unexpected tensor {name!r} in a DiffusionGemma checkpoint")
                ours = name.removeprefix("model.decoder.")
                if ours == "embed_tokens.weight":
                    ours = "embed_tokens"
                elif ours.startswith("self_conditioning.") and not ours.startswith(
                        "self_conditioning.pre_norm"):
                    ours = ours.replace("self_conditioning.", "self_conditioning.mlp.", 1)
                sources[ours] = name
                yield ours, tensor

        consumed = load_checkpoint_weights(self, translated())
        return {sources.get(name, name) for name in consumed} | skipped
