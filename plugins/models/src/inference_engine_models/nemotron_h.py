"""Nemotron-H (the Nemotron 3 family): a hybrid of Mamba-2, attention, MoE and MLP layers.

Each layer is a pre-norm residual block holding exactly one mixer, picked by
``config.layers_block_type`` (or the older ``hybrid_override_pattern``, which
transformers turns into it): ``linear_attention`` is a Mamba-2 mixer
(:class:`~inference_engine.layers.mamba2.Mamba2Mixer`, with per-sequence conv and
SSM state), ``full_attention`` is GQA attention *without* rotary (position comes
from the Mamba layers), ``moe`` is a sigmoid-routed MoE of non-gated relu² experts
(router in float32 with a correction bias, shared expert always on), ``mlp`` a
non-gated relu² MLP. Checkpoint names are transformers' (``backbone.layers.N.mixer...``,
experts one tensor per expert and projection). The multi-token-prediction layers
(``mtp.*``) are not used and skipped on load, as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import CausalLM, ModelContext
from inference_engine.layers.attention import Attention
from inference_engine.layers.embedding import LMHead, VocabEmbedding
from inference_engine.layers.linear import QKVParallelLinear, ReplicatedLinear, RowLinear
from inference_engine.layers.mamba2 import Mamba2Config, Mamba2Mixer
from inference_engine.layers.moe import RELU2, FusedMoE, RouterSpec, route
from inference_engine.layers.norm import RMSNorm
from inference_engine.layers.weights import load_checkpoint_weights
from torch import nn

__all__ = ["NemotronHForCausalLM"]

BLOCK_TYPES = ("linear_attention", "full_attention", "moe", "mlp")


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, Nemotron-H's MLP and expert activation."""
    return torch.square(F.relu(x))


class Relu2MLP(nn.Module):
    """``down(relu(up(x))^2)``: no gate."""

    def __init__(self, ctx: ModelContext, hidden_size: int, intermediate_size: int, prefix: str,
                 bias: bool = False) -> None:
        super().__init__()
        self.up_proj = ReplicatedLinear(ctx, hidden_size, intermediate_size, f"{prefix}.up_proj",
                                        bias=bias)
        self.down_proj = RowLinear(ctx, intermediate_size, hidden_size, f"{prefix}.down_proj",
                                   bias=bias)

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata | None = None) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """Sigmoid top-k routing (float32 router, correction bias for the choice, optional
    groups, renormalised, scaled), relu² experts, an always-on shared relu² expert."""

    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if getattr(cfg, "moe_latent_size", None) is not None:
            raise ValueError(f"{prefix}: moe_latent_size (latent expert projections) is not "
                             f"supported")
        self.routing = RouterSpec(
            num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
            renormalize=bool(cfg.norm_topk_prob), num_groups=cfg.n_group,
            topk_groups=cfg.topk_group, group_score="top2_sum",
            routed_scaling_factor=float(cfg.routed_scaling_factor))
        self.gate = _Router(cfg.n_routed_experts, cfg.hidden_size)
        self.experts = FusedMoE(ctx, cfg.n_routed_experts, cfg.hidden_size,
                                cfg.moe_intermediate_size, f"{prefix}.experts", activation=RELU2)
        self.shared_experts = Relu2MLP(ctx, cfg.hidden_size,
                                       cfg.moe_shared_expert_intermediate_size,
                                       f"{prefix}.shared_experts", bias=bool(cfg.mlp_bias))

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata | None = None) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = route(logits, self.routing, self.gate.e_score_correction_bias)
        return self.experts(x, weights, ids) + self.shared_experts(x)


class _Router(nn.Module):
    """The router's float32 weight and correction bias (``mixer.gate.*``)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)


class NemotronHAttention(nn.Module):
    """GQA attention with no positional rotation; q/k/v fused, paged through the backend."""

    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(ctx, cfg.hidden_size, self.num_heads, self.num_kv_heads,
                                          self.head_dim, f"{prefix}.qkv_proj", bias=bias)
        self.o_proj = RowLinear(ctx, self.q_size, cfg.hidden_size, f"{prefix}.o_proj", bias=bias)
        self.attn = Attention(ctx, self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim**-0.5, f"{prefix}.attn",
                              sliding_window=getattr(cfg, "sliding_window", None))

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, metadata))


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``; the residual add is fused into the next block's norm."""

    def __init__(self, ctx: ModelContext, layer_idx: int, block_type: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        prefix = f"backbone.layers.{layer_idx}.mixer"
        self.block_type = block_type
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, ctx.dtype)
        if block_type == "linear_attention":
            self.mixer: nn.Module = Mamba2Mixer(ctx, prefix, Mamba2Config(cfg))
        elif block_type == "full_attention":
            self.mixer = NemotronHAttention(ctx, prefix)
        elif block_type == "moe":
            self.mixer = NemotronHMoE(ctx, prefix)
        else:
            self.mixer = Relu2MLP(ctx, cfg.hidden_size, cfg.intermediate_size, prefix,
                                  bias=bool(cfg.mlp_bias))

    def cpu_decode_blocker(self) -> str:
        """The C++ whole-step decode runs only the Llama-family decoder layer."""
        return f"a Nemotron-H {self.block_type} block"

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mixer output, residual stream)``; their sum is the block's output."""
        if residual is None:
            residual = hidden
            hidden = self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden, metadata), residual


class NemotronHModel(nn.Module):
    """Embedding, hybrid blocks and final norm (the checkpoint's ``backbone.``)."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        types = list(cfg.layers_block_type)
        unknown = sorted(set(types) - set(BLOCK_TYPES))
        if unknown:
            raise ValueError(f"Nemotron-H: unsupported layers_block_type entries {unknown}; "
                             f"supported: {list(BLOCK_TYPES)}")
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype)
        self.layers = nn.ModuleList(NemotronHBlock(ctx, i, kind) for i, kind in enumerate(types))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, ctx.dtype)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, metadata)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H / Nemotron 3 (``NemotronHForCausalLM``), transformers' ``nemotron_h``."""

    # Checkpoint prefixes that are not weights of this model (multi-token prediction).
    skipped_prefixes = ("mtp.",)

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.backbone = NemotronHModel(ctx)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                              tied_to=self.backbone.embeddings if tied else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.backbone(self.backbone.embeddings(input_ids), metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load transformers' names (``model.`` is read as ``backbone.``); ``mtp.*`` skipped.

        Raises:
            ValueError: listing unexpected, mismatched and missing tensors.
        """
        tied = self.lm_head.is_tied
        original: dict[str, str] = {}

        def renamed(items: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
            for name, tensor in items:
                new = "backbone." + name[len("model."):] if name.startswith("model.") else name
                if new != name:
                    original[new] = name
                yield new, tensor

        def ignore(name: str) -> bool:
            return name.startswith(self.skipped_prefixes) or (tied and name == "lm_head.weight")

        consumed = load_checkpoint_weights(self, renamed(weights), ignore=ignore)
        return {original.get(name, name) for name in consumed}
