"""Whisper (``WhisperForConditionalGeneration``): speech encoder, paged text decoder.

The encoder (two GELU convolutions, sinusoidal positions, pre-LN bidirectional
layers) runs once per request on its 30 s window of log-mel features, batched
with the other requests that start in the same step. Each decoder layer's
cross-attention K/V of that output are computed then and kept per request
(:class:`CrossAttentionStore`) until the engine releases the request; the
decoder's self-attention K/V live in the paged pool like any decoder's, so
decoder tokens batch, chunk, preempt and recompute as text requests do.

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
from inference_engine.layers import (
    Attention,
    LMHead,
    ReplicatedLinear,
    RowLinear,
    VocabEmbedding,
    load_checkpoint_weights,
)
from torch import nn

__all__ = ["CrossAttentionStore", "WhisperForConditionalGeneration"]

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


class CrossAttentionStore:
    """Each request's cross-attention K/V, per decoder layer, from its encoder output.

    NOTE: held per request, outside the paged pool: a request's encoder output has a fixed
    length (``max_source_positions``), computed once and read by every decode step, so
    paging it buys nothing; it is freed when the engine releases the request.
    """

    def __init__(self) -> None:
        # request id -> per layer (k, v), each [frames, heads, head_dim].
        self.states: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __len__(self) -> int:
        return len(self.states)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        d, h = cfg.d_model, cfg.decoder_attention_heads
        self.num_heads, self.head_dim = h, d // h
        self.self_attn = _Projections(ctx, d, f"{prefix}.self_attn")
        self.attn = Attention(ctx, h, d // h, h, (d // h) ** -0.5, f"{prefix}.self_attn")
        self.self_attn_layer_norm = _layer_norm(d, ctx)
        self.encoder_attn = _Projections(ctx, d, f"{prefix}.encoder_attn")
        self.encoder_attn_layer_norm = _layer_norm(d, ctx)
        self.mlp = _MLP(ctx, d, cfg.decoder_ffn_dim, cfg.activation_function, prefix)
        self.final_layer_norm = _layer_norm(d, ctx)

    def cross_kv(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``encoded [frames, d]`` -> K, V ``[frames, heads, head_dim]``."""
        shape = (encoded.shape[0], self.num_heads, self.head_dim)
        return (self.encoder_attn.k_proj(encoded).view(shape),
                self.encoder_attn.v_proj(encoded).view(shape))

    def cross_attend(self, x: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                     query_lens: list[int]) -> torch.Tensor:
        """Each sequence's queries attend its own request's encoder K/V (no mask: every
        encoder position is valid); sequences are padded to the longest query."""
        t, d = x.shape
        h, hd = self.num_heads, self.head_dim
        q = self.encoder_attn.q_proj(x).view(t, h, hd)
        k = torch.stack([pair[0] for pair in kv]).transpose(1, 2)
        v = torch.stack([pair[1] for pair in kv]).transpose(1, 2)
        longest = max(query_lens)
        if longest == 1:  # pure decode: one query per sequence, no padding
            qb = q.unsqueeze(2)
        else:
            qb = q.new_zeros(len(query_lens), longest, h, hd)
            start = 0
            for i, n in enumerate(query_lens):
                qb[i, :n] = q[start : start + n]
                start += n
            qb = qb.transpose(1, 2)
        # o: [seqs, heads, longest, head_dim]
        o = F.scaled_dot_product_attention(qb, k, v, scale=hd ** -0.5).transpose(1, 2)
        if longest == 1:
            out = o.reshape(t, d)
        else:
            out = torch.cat([o[i, :n] for i, n in enumerate(query_lens)]).reshape(t, d)
        return self.encoder_attn.out_proj(out)

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata,
                kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        proj = self.self_attn
        y = self.self_attn_layer_norm(x)
        x = x + proj.out_proj(self.attn(proj.q_proj(y), proj.k_proj(y), proj.v_proj(y),
                                        metadata))
        if kv is not None:
            x = x + self.cross_attend(self.encoder_attn_layer_norm(x), kv,
                                      metadata.query_lens_list)
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

    # Cross-attention reads per-request state chosen on the host each step.
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
        self.store = CrossAttentionStore()
        # The step's per-sequence cross K/V per layer (set by prepare_encoder).
        self._step_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None

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
    def prepare_encoder(self, request_ids: Sequence[str] | None,
                        encoder_inputs: Sequence[Any] | None) -> None:
        if request_ids is None:
            self._step_kv = None
            return
        inputs = encoder_inputs or [None] * len(request_ids)
        new = {rid: feats for rid, feats in zip(request_ids, inputs, strict=True)
               if rid not in self.store}
        missing = [rid for rid, feats in new.items() if feats is None]
        if missing:
            raise ValueError(f"Whisper: request(s) {missing[:4]} have no audio features")
        if new:
            self._encode(list(new), list(new.values()))
        states = [self.store.states[rid] for rid in request_ids]
        self._step_kv = [[state[layer] for state in states]
                         for layer in range(len(self.model.decoder.layers))]

    def _encode(self, request_ids: list[str], features: list[torch.Tensor]) -> None:
        dtype = self.ctx.dtype
        batch = torch.stack(features).to(self.ctx.device, dtype)
        encoded = self.model.encoder(batch)
        for i, rid in enumerate(request_ids):
            self.store.states[rid] = [layer.cross_kv(encoded[i])
                                      for layer in self.model.decoder.layers]

    def release_encoder(self, request_id: str) -> None:
        self.store.states.pop(request_id, None)

    @property
    def num_encoder_states(self) -> int:
        return len(self.store)

    # ---- decoder -------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) * dec.embed_scale + dec.embed_positions(positions)
        step_kv = self._step_kv
        for i, layer in enumerate(dec.layers):
            x = layer(x, metadata, step_kv[i] if step_kv is not None else None)
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
