"""Whisper (``WhisperForConditionalGeneration``): speech encoder, paged text decoder.

The encoder (two GELU convolutions, sinusoidal positions, pre-LN bidirectional
layers) runs once per request on its 30 s window of log-mel features, batched
with the other requests that start in the same step. Each decoder layer's
cross-attention K/V of that output are fixed-size per-sequence state
(:class:`WhisperCrossAttention` declares a ``StateCacheSpec``): the encoder step
writes them into the sequence's slot of the engine's state pool on its first
step (again after a preemption, which frees the slot), and every step reads
them by slot on the device. The decoder's self-attention K/V live in the paged
pool like any decoder's, so decoder tokens batch, chunk, preempt and recompute
as text requests do; the slot is freed with the request's blocks.

Checkpoint names are transformers' (``model.encoder.*``, ``model.decoder.*``);
``proj_out`` is tied to the token embedding unless ``tie_word_embeddings`` is off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.encoder_decoder import EncoderDecoderLM
from inference_engine.interfaces.model import ModelContext
from inference_engine.interfaces.state_cache import StateCacheSpec, StateTensorSpec
from inference_engine.layers import (
    Attention,
    LMHead,
    ReplicatedLinear,
    RowLinear,
    VocabEmbedding,
    load_checkpoint_weights,
)
from torch import nn

__all__ = ["WhisperCrossAttention", "WhisperForConditionalGeneration"]

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


def _activation(name: str) -> Any:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"Whisper: activation_function {name!r} is not supported "
                         f"(supported: {', '.join(_ACTIVATIONS)})") from None


class _Projections(nn.Module):
    """Whisper's q/k/v/out projections (q, v and out have biases, k has none)."""

    def __init__(self, ctx: ModelContext, dim: int, prefix: str) -> None:
        super().__init__()
        self.q_proj = ReplicatedLinear(ctx, dim, dim, f"{prefix}.q_proj", bias=True)
        self.k_proj = ReplicatedLinear(ctx, dim, dim, f"{prefix}.k_proj", bias=False)
        self.v_proj = ReplicatedLinear(ctx, dim, dim, f"{prefix}.v_proj", bias=True)
        self.out_proj = RowLinear(ctx, dim, dim, f"{prefix}.out_proj", bias=True)


class _MLP(nn.Module):
    def __init__(self, ctx: ModelContext, dim: int, ffn: int, act: str, prefix: str) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(ctx, dim, ffn, f"{prefix}.fc1", bias=True)
        self.fc2 = RowLinear(ctx, ffn, dim, f"{prefix}.fc2", bias=True)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _layer_norm(dim: int, ctx: ModelContext) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=1e-5, dtype=ctx.dtype)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.num_heads = cfg.encoder_attention_heads
        self.self_attn = _Projections(ctx, cfg.d_model, f"{prefix}.self_attn")
        self.self_attn_layer_norm = _layer_norm(cfg.d_model, ctx)
        self.mlp = _MLP(ctx, cfg.d_model, cfg.encoder_ffn_dim, cfg.activation_function, prefix)
        self.final_layer_norm = _layer_norm(cfg.d_model, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [batch, frames, d_model]
        b, t, d = x.shape
        h = self.num_heads
        attn = self.self_attn
        y = self.self_attn_layer_norm(x).reshape(b * t, d)
        q, k, v = (p(y).view(b, t, h, d // h).transpose(1, 2)
                   for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, scale=(d // h) ** -0.5)
        x = x + attn.out_proj(o.transpose(1, 2).reshape(b * t, d)).view(b, t, d)
        return x + self.mlp(self.final_layer_norm(x).reshape(b * t, d)).view(b, t, d)


class WhisperEncoder(nn.Module):
    """Log-mel features ``[batch, n_mels, 2 * max_source_positions]`` -> ``[batch, frames, d]``."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, 3, padding=1, dtype=ctx.dtype)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, 3, stride=2, padding=1, dtype=ctx.dtype)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model,
                                            dtype=ctx.dtype)
        self.layers = nn.ModuleList(WhisperEncoderLayer(ctx, f"model.encoder.layers.{i}")
                                    for i in range(cfg.encoder_layers))
        self.layer_norm = _layer_norm(cfg.d_model, ctx)
        self.act = _activation(cfg.activation_function)
        self.num_frames = 2 * cfg.max_source_positions
        self.num_mel_bins = cfg.num_mel_bins

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(features))
        x = self.act(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperCrossAttention(_Projections):
    """A decoder layer's attention to its sequence's encoder output.

    The K/V of the encoder output (``[heads, encoder_len, head_dim]`` each, the model
    dtype) are per-sequence state of a fixed size: the engine's state pool holds them
    in the sequence's slot (``state_cache``, bound by the model runner), written once by
    :meth:`write` on the sequence's first step and read by every step through the
    step's ``state_slots``, all sequences in one gather.
    """

    def __init__(self, ctx: ModelContext, dim: int, heads: int, encoder_len: int,
                 prefix: str) -> None:
        super().__init__(ctx, dim, prefix)
        self.num_heads, self.head_dim = heads, dim // heads
        self.encoder_len = encoder_len
        self.dtype = ctx.dtype
        # (K, V), each [num_slots, heads, encoder_len, head_dim]; bound by the runner.
        self.state_cache: tuple[torch.Tensor, ...] | None = None

    def state_cache_spec(self) -> StateCacheSpec:
        one = StateTensorSpec((self.num_heads, self.encoder_len, self.head_dim), self.dtype)
        return StateCacheSpec((one, one))

    def _bound_cache(self) -> tuple[torch.Tensor, ...]:
        if self.state_cache is None:
            raise RuntimeError("Whisper cross-attention has no state cache: the model runner "
                               "binds WhisperCrossAttention.state_cache before a forward")
        return self.state_cache

    def write(self, encoded: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the K/V of ``encoded [seqs, encoder_len, d]`` in ``slots [seqs]``."""
        n, t, d = encoded.shape
        flat = encoded.reshape(n * t, d)
        shape = (n, t, self.num_heads, self.head_dim)
        for cache, proj in zip(self._bound_cache(), (self.k_proj, self.v_proj), strict=True):
            cache.index_copy_(0, slots, proj(flat).view(shape).transpose(1, 2).to(cache.dtype))

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Each sequence's queries attend its own slot's encoder K/V (no mask: every encoder
        position is valid); sequences are padded to the longest query."""
        if metadata.state_slots is None:
            raise RuntimeError("Whisper cross-attention needs the step's state_slots")
        k_cache, v_cache = self._bound_cache()
        t, d = x.shape
        h, hd = self.num_heads, self.head_dim
        query_lens = metadata.query_lens_list
        slots = metadata.state_slots
        # [seqs, heads, encoder_len, head_dim], one gather per tensor for the whole step.
        k, v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
        q = self.q_proj(x).view(t, h, hd)
        seqs, longest = len(query_lens), max(query_lens)
        if longest == 1:  # pure decode: one query per sequence, no padding
            qb = q.unsqueeze(2)
        else:
            rows = _padded_rows(metadata, longest, q.device)
            qb = q.new_zeros(seqs * longest, h, hd).index_copy_(0, rows, q)
            qb = qb.view(seqs, longest, h, hd).transpose(1, 2)
        # o: [seqs, heads, longest, head_dim]
        o = F.scaled_dot_product_attention(qb, k, v, scale=hd ** -0.5).transpose(1, 2)
        if longest == 1:
            out = o.reshape(t, d)
        else:
            out = o.reshape(seqs * longest, d).index_select(0, rows)
        return self.out_proj(out)


def _padded_rows(metadata: AttentionMetadata, longest: int, device: torch.device) -> torch.Tensor:
    """Each token's row in the step's queries padded to ``[seqs, longest]`` (sequence i's
    j-th token -> ``i * longest + j``); built once per step, shared by every layer."""
    rows = metadata.backend_cache.get("whisper_padded_rows")
    if rows is None:
        rows = torch.tensor([i * longest + j for i, n in enumerate(metadata.query_lens_list)
                             for j in range(n)], dtype=torch.int64).to(device)
        metadata.backend_cache["whisper_padded_rows"] = rows
    return rows


class WhisperDecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        d, h = cfg.d_model, cfg.decoder_attention_heads
        self.num_heads, self.head_dim = h, d // h
        self.self_attn = _Projections(ctx, d, f"{prefix}.self_attn")
        self.attn = Attention(ctx, h, d // h, h, (d // h) ** -0.5, f"{prefix}.self_attn")
        self.self_attn_layer_norm = _layer_norm(d, ctx)
        self.encoder_attn = WhisperCrossAttention(ctx, d, h, cfg.max_source_positions,
                                                  f"{prefix}.encoder_attn")
        self.encoder_attn_layer_norm = _layer_norm(d, ctx)
        self.mlp = _MLP(ctx, d, cfg.decoder_ffn_dim, cfg.activation_function, prefix)
        self.final_layer_norm = _layer_norm(d, ctx)

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        proj = self.self_attn
        y = self.self_attn_layer_norm(x)
        x = x + proj.out_proj(self.attn(proj.q_proj(y), proj.k_proj(y), proj.v_proj(y),
                                        metadata))
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), metadata)
        return x + self.mlp(self.final_layer_norm(x))


class WhisperDecoder(nn.Module):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.d_model, ctx.dtype)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model,
                                            dtype=ctx.dtype)
        self.layers = nn.ModuleList(WhisperDecoderLayer(ctx, f"model.decoder.layers.{i}")
                                    for i in range(cfg.decoder_layers))
        self.layer_norm = _layer_norm(cfg.d_model, ctx)
        self.embed_scale = cfg.d_model ** 0.5 if cfg.scale_embedding else 1.0


class _WhisperModel(nn.Module):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(ctx)
        self.decoder = WhisperDecoder(ctx)


class WhisperForConditionalGeneration(EncoderDecoderLM):
    """Whisper speech recognition and translation over the engine's paged decoder."""

    # The encoder runs on the host's say (prepare_encoder) outside the forward; a replayed
    # decode graph would skip it for a one-token decoder prompt.
    graph_safe = False

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        if ctx.max_model_len > cfg.max_target_positions:
            raise ValueError(f"Whisper decodes at most max_target_positions="
                             f"{cfg.max_target_positions} tokens; --max-model-len "
                             f"{ctx.max_model_len} is longer")
        if cfg.d_model % cfg.decoder_attention_heads or cfg.d_model % cfg.encoder_attention_heads:
            raise ValueError("Whisper: d_model must be a multiple of the attention heads")
        self.model = _WhisperModel(ctx)
        tied = getattr(cfg, "tie_word_embeddings", True)
        self.proj_out = LMHead(cfg.vocab_size, cfg.d_model, ctx.dtype,
                               tied_to=self.model.decoder.embed_tokens if tied else None)

    # ---- encoder state ---------------------------------------------------------------
    def encoder_input_error(self, encoder_inputs: Any) -> str | None:
        enc = self.model.encoder
        expected = (enc.num_mel_bins, enc.num_frames)
        if not isinstance(encoder_inputs, torch.Tensor):
            return "Whisper needs log-mel features (a tensor) as encoder inputs"
        if tuple(encoder_inputs.shape) != expected:
            return (f"Whisper needs features of shape {expected} (mel bins, frames); got "
                    f"{tuple(encoder_inputs.shape)}")
        return None

    @torch.inference_mode()
    def prepare_encoder(self, encoder_inputs: Sequence[Any] | None,
                        metadata: AttentionMetadata) -> None:
        if encoder_inputs is None:
            return
        rows = [i for i, feats in enumerate(encoder_inputs) if feats is not None]
        if not rows:
            return
        if metadata.state_slots is None:
            raise RuntimeError("Whisper's encoder needs the step's state_slots to store into")
        batch = torch.stack([encoder_inputs[i] for i in rows]).to(self.ctx.device, self.ctx.dtype)
        encoded = self.model.encoder(batch)
        slots = metadata.state_slots[torch.tensor(rows, device=metadata.state_slots.device)]
        for layer in self.model.decoder.layers:
            layer.encoder_attn.write(encoded, slots)

    # ---- decoder -------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) * dec.embed_scale + dec.embed_positions(positions)
        for layer in dec.layers:
            x = layer(x, metadata)
        return dec.layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load transformers' names; the MLP's ``fc1``/``fc2`` sit on the layer there."""
        tied = self.proj_out.is_tied

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if tied and name == "proj_out.weight":
                    continue
                for part in (".fc1.", ".fc2."):
                    if part in name:
                        name = name.replace(part, f".mlp{part}")
                yield name, tensor

        return load_checkpoint_weights(self, renamed(), stacked={})
