"""Attention backend interface and the metadata every backend receives per step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheSpec"]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one attention layer keeps per token in the paged cache.

    The pool is laid out block-wise: one physical block holds every layer's
    entries for ``block_size`` tokens in one contiguous byte range, so layers
    with different specs (MLA latents, indexer keys) fit the same pool.
    """

    # Number of tensors stored per token (2 for K and V; 1 for an MLA latent).
    num_tensors: int
    # Heads per tensor (KV heads for K/V; 1 for a latent).
    num_heads: int
    # Elements per head.
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_tensors * block_size * self.num_heads * self.head_dim * elem


@dataclass(slots=True)
class AttentionMetadata:
    """The flattened batch of one step, as attention needs it.

    Sequences are ordered decodes first: the first ``num_decodes`` have a
    query length of one. Host-side lists mirror the tensors for backends that
    loop over sequences.
    """

    # Tokens in the step, summed over sequences.
    num_tokens: int
    num_decodes: int
    # [num_seqs + 1] int64 offsets of each sequence's queries in the flat batch.
    query_start_loc: torch.Tensor
    # [num_seqs] int64 tokens in context after this step (cached + new).
    seq_lens: torch.Tensor
    # [num_tokens] int64 flat cache slot (block_id * block_size + offset) per new token.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks] int64 physical block ids. Entries past a sequence's last
    # block are 0 up to the step's widest sequence and unspecified beyond: read only the
    # ceil(seq_len / block_size) blocks a sequence has.
    block_tables: torch.Tensor
    block_size: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # [num_tokens] int64 block id and in-block offset of each new token's slot;
    # per-layer cache views are strided across blocks, so writes index both.
    slot_blocks: torch.Tensor | None = None
    slot_offsets: torch.Tensor | None = None
    # Longest context among the decodes, so batched decode gathers no more blocks than needed.
    max_decode_seq_len: int = 0
    # Host upper bounds for kernel grids: the longest query chunk and the longest context
    # of the step. A captured (CUDA-graph) step sets them to the bucket's bounds, so
    # backends size launches from these and never read a device tensor on the host.
    max_query_len: int = 0
    max_seq_len: int = 0
    # Whether this step runs inside graph capture/replay: the rows past the real batch are
    # padding (query length 1, context length 0, slot -1) and must write nothing.
    is_graph_step: bool = False
    # [num_seqs] int64 each sequence's slot of the per-sequence state pool (layers that declare
    # a StateCacheSpec read it); None when the model has no such layer.
    state_slots: torch.Tensor | None = None
    # Scratch for tensors a backend derives from this step's layout once and
    # reuses in every layer (keyed by the backend; cleared with the step).
    backend_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged cache.

    Implementations write the new K/V into the cache at ``slot_mapping`` and
    attend each query to its sequence's cached context causally (within
    ``sliding_window`` when set). A negative slot is padding: nothing is written.
    """

    # Whether the backend honours ``sinks``; layers that need them refuse other backends.
    supports_sinks: bool = False
    # Whether the backend honours ``sliding_window``.
    supports_sliding_window: bool = True
    # Whether ``forward`` is free of host synchronisation and host reads of device values,
    # so a decode step through it can be captured in a CUDA graph.
    graph_safe: bool = False

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        """Whether the backend's kernels handle ``head_dim``."""
        return True

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype) -> bool:
        """Whether the backend reads and writes a cache of ``dtype``."""
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    # [num_heads] learned per-head logits added to each softmax's denominator (gpt-oss
    # attention sinks), set by the attention layer; None for ordinary attention.
    sinks: torch.Tensor | None = None
    # Per-tensor scales of a float8 cache (stored values are ``x / scale``), set by the attention
    # layer from the checkpoint's ``k_scale``/``v_scale`` (else 1.0). A backend that lists a
    # float8 dtype in supports_kv_cache_dtype honours them; other caches ignore them.
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window

    def prepare(self, device: torch.device, kv_dtype: torch.dtype) -> None:  # noqa: B027
        """Called once at start-up with the cache's device and dtype.

        Build or load kernels here, so the first request does not pay for it.
        """

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend and return ``[num_tokens, num_heads * head_dim]``.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]`` for the new tokens.
            kv_cache: (k_cache, v_cache), each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            metadata: the step's batch layout.
        """

    def forward_prefix_block(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """"Cached prefix + bidirectional block" mode (block diffusion's denoiser): each
        sequence's queries attend its cached prefix and, non-causally, the whole block;
        the block's ``key``/``value`` are scratch and nothing is written to the cache.

        ``metadata.seq_lens_list`` holds the cached prefix lengths (the block excluded).
        The built-in backends take the gather + SDPA implementation
        (``builtin.attention.prefix_block.PrefixBlockAttention``, usable by any backend over
        the pool's layout); a backend may override it with a kernel.

        Raises:
            NotImplementedError: a backend without this mode.
        """
        raise NotImplementedError(f"{type(self).__name__} has no cached-prefix + "
                                  "bidirectional-block mode (block-diffusion models)")
