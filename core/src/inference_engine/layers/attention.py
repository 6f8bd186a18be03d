"""The attention layer: one per decoder layer, owning that layer's KV cache views.

The model runner finds every :class:`Attention` in ``model.modules()`` order,
sizes the paged pool from their :meth:`Attention.kv_cache_spec`, and binds
each layer's ``(k_cache, v_cache)`` views to :attr:`Attention.kv_cache`.

A float8 cache stores ``x / scale`` with one scale for K and one for V per layer.
Checkpoints quantized for FP8 KV caches carry them (``self_attn.k_scale``, ModelOpt's
``k_proj.k_scale``, compressed-tensors' ``k_proj.output_scale``, older ``kv_scale``):
:data:`CHECKPOINT_KV_SCALES` names them, the layer loads them into its ``k_scale``
and ``v_scale`` parameters, and hands them to its backend once loaded; without them
the scales are 1.0, as in vLLM.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from inference_engine.interfaces.attention import AttentionBackend, AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import ModelContext

__all__ = ["CHECKPOINT_KV_SCALES", "Attention", "choose_backend"]

logger = logging.getLogger(__name__)

# Checkpoint names of per-tensor KV-cache scales, relative to the module that holds the
# Attention layer (``...self_attn``) -> the layer parameters they fill.
CHECKPOINT_KV_SCALES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k_scale",),
    "v_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),  # one scale for both (older FP8 checkpoints)
    "attn.k_scale": ("k_scale",),
    "attn.v_scale": ("v_scale",),
    "k_proj.k_scale": ("k_scale",),  # ModelOpt
    "v_proj.v_scale": ("v_scale",),
    "k_proj.output_scale": ("k_scale",),  # compressed-tensors
    "v_proj.output_scale": ("v_scale",),
}
_NOTED_UNUSED_SCALES: set[str] = set()


def choose_backend(ctx: ModelContext, prefix: str, head_dim: int, kv_dtype: torch.dtype,
                   sinks: bool, sliding_window: bool) -> type[AttentionBackend]:
    """The layer's backend class: the first candidate (``attention_backend="auto"``) that
    supports its head size, sinks, window and cache dtype; else the one configured.

    Raises:
        ValueError: no candidate supports the layer (the message says what each lacks).
    """
    if not ctx.attention_backend_candidates:
        return ctx.attention_backend
    reasons = []
    for cls in ctx.attention_backend_candidates:
        lacks = [
            what for what, ok in (
                (f"head size {head_dim}", cls.supports_head_size(head_dim)),
                (f"a {str(kv_dtype).removeprefix('torch.')} KV cache",
                 cls.supports_kv_cache_dtype(kv_dtype)),
                ("attention sinks", not sinks or cls.supports_sinks),
                ("sliding windows", not sliding_window or cls.supports_sliding_window),
            ) if not ok
        ]
        if not lacks:
            return cls
        reasons.append(f"{getattr(cls, 'name', cls.__name__)}: no {', '.join(lacks)}")
    raise ValueError(f"{prefix}: no attention backend supports this layer ({'; '.join(reasons)})")


class Attention(nn.Module):
    """Paged causal attention through ``ctx.attention_backend``.

    Args:
        ctx: the model context (backend class, dtype).
        num_heads: query heads.
        head_dim: dims per head.
        num_kv_heads: key/value heads (fewer than ``num_heads`` under GQA).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        prefix: dotted module name, for messages.
        sliding_window: attend only the last this-many positions, or None.
        sinks: ``[num_heads]`` attention-sink logits (gpt-oss), or None.

    Raises:
        ValueError: for sinks on a backend that does not support them.
    """

    def __init__(self, ctx: ModelContext, num_heads: int, head_dim: int, num_kv_heads: int,
                 scale: float, prefix: str, sliding_window: int | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{prefix}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        self.prefix = prefix
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.dtype = ctx.kv_cache_dtype or ctx.dtype
        backend_cls = choose_backend(ctx, prefix, head_dim, self.dtype,
                                     sinks is not None, sliding_window is not None)
        self.backend = backend_cls(num_heads, head_dim, num_kv_heads, scale, sliding_window)
        if sinks is not None:
            if not self.backend.supports_sinks:
                raise ValueError(f"{prefix}: the {type(self.backend).__name__} attention backend "
                                 f"does not support attention sinks")
            self.backend.sinks = sinks
        # Per-tensor float8 cache scales, loaded from the checkpoint when it has them
        # (buffers: they are not weights, and nothing randomises or counts them as such).
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)
        # (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim];
        # bound by the runner once the pool exists.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    # Checkpoint scale names this layer answers to (see weights.load_checkpoint_weights).
    checkpoint_kv_scales = CHECKPOINT_KV_SCALES

    def load_kv_scale(self, which: str, loaded: torch.Tensor) -> None:
        """Set ``k_scale`` or ``v_scale`` from a checkpoint tensor of one element.

        Raises:
            ValueError: the tensor holds more than one scale (per-head or per-channel).
        """
        if loaded.numel() != 1:
            raise ValueError(
                f"expected one per-tensor KV-cache scale, got shape {tuple(loaded.shape)} "
                f"(per-head or per-channel KV scales are not supported)"
            )
        getattr(self, which).copy_(loaded.reshape(()).float())

    def process_weights_after_loading(self) -> None:
        """Give a float8 cache's backend the loaded scales (read once, at load time).

        Raises:
            ValueError: a scale of a float8 cache that is not positive and finite.
        """
        k_scale, v_scale = float(self.k_scale), float(self.v_scale)
        if self.dtype != torch.float8_e4m3fn:
            if (k_scale, v_scale) != (1.0, 1.0) and "unused" not in _NOTED_UNUSED_SCALES:
                _NOTED_UNUSED_SCALES.add("unused")
                logger.info("the checkpoint's KV-cache scales are unused: the cache is %s "
                            "(--kv-cache-dtype fp8 uses them)", self.dtype)
            return
        for which, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{self.prefix}: {which} {value} is not a positive, finite "
                                 f"scale for a float8 KV cache")
        self.backend.k_scale, self.backend.v_scale = k_scale, v_scale

    def kv_cache_spec(self) -> KVCacheSpec:
        """What this layer stores per token: K and V of ``num_kv_heads`` heads."""
        return KVCacheSpec(num_tensors=2, num_heads=self.num_kv_heads, head_dim=self.head_dim,
                           dtype=self.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Attend the step's tokens; returns ``[T, num_heads * head_dim]``.

        Args:
            q: ``[T, num_heads * head_dim]`` or ``[T, num_heads, head_dim]``.
            k, v: ``[T, num_kv_heads * head_dim]`` or ``[T, num_kv_heads, head_dim]``;
                views into a fused projection are fine (only the last dim must be dense).
            metadata: the step's batch layout.

        Raises:
            RuntimeError: when no cache has been bound.
        """
        if self.kv_cache is None:
            raise RuntimeError(
                f"{self.prefix}: no KV cache bound; the model runner sets Attention.kv_cache "
                f"after allocating the pool"
            )
        t = q.shape[0]
        return self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
        )

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sliding_window={self.sliding_window}, backend={type(self.backend).__name__}")
