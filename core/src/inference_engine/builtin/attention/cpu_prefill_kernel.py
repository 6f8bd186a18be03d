"""A C++ prefill-attention kernel for CPU that reads the paged cache in place.

Prefill chunks (fresh prompts and chunks after cached context alike) attend
keys ``0..pos`` of their own sequence, all of which are in the cache once the
step's K/V are written. The kernel walks each sequence's block table a cache
block (16 keys) at a time, flash-attention style: the block's keys are
transposed into a small float32 tile, the scores of up to 8 query rows come
from broadcast FMAs over it (no horizontal sums), an online softmax rescales
the running output, and causal or sliding-window keys are masked per row.
Blocks wholly in a row's future are skipped, so the causal half costs
nothing. Tasks are (sequence, KV head, 32-query slice), all query heads of a
KV head together, run on the core's spinning pool.

Replaces torch's float32 flash SDPA plus a context gather for continued
chunks (timings in ``docs/benchmarks.md``, "CPU kernel timings"). AVX-512 or
AVX2 with FMA (16-float vectors as one or two registers, ``csrc/ie_simd_helpers.h``;
half the register block on AVX2), float32 queries, float32 or bfloat16 caches, head sizes of 32/48/64/96/128/256, no
sinks; everything else keeps the torch path, which is the reference it is
tested against. The C++ is ``csrc/cpu_prefill_attention.cpp``, built on first
use by :mod:`inference_engine.cpu_extensions`.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_engine.builtin.attention.cpu_decode_kernel import reads_cache
from inference_engine.cpu_extensions import CpuKernelBuild
from inference_engine.cpu_thread_pool import load_pooled_build

__all__ = ["PREFILL_BUILD", "paged_prefill_attention", "prefill_kernel"]

# Head sizes the kernel is instantiated for.
_HEAD_SIZES = (32, 48, 64, 96, 128, 256)


PREFILL_BUILD = CpuKernelBuild("inference_engine_cpu_prefill", ("cpu_prefill_attention.cpp",),
                               "the CPU paged-prefill attention kernel")


def prefill_kernel() -> Any | None:
    """The compiled extension, or None where it cannot be built or the CPU lacks AVX-512 and AVX2."""
    module = load_pooled_build(PREFILL_BUILD)
    if module is None or not module.available():
        return None
    return module


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """``[T, heads, head_dim]`` causal attention of prefill chunks read from the cache,
    or None to use the torch path.

    Args:
        query: ``[T, heads, head_dim]`` float32, the chunks' queries end to end.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` layer views,
            float32 or bfloat16, already holding the chunks' own K/V.
        block_tables: ``[S, >= blocks in use]`` int64, one row per chunk.
        query_lens: tokens of each chunk; ``seq_lens``: its sequence's length after it.
    """
    if not reads_cache(query, k_cache) or query.shape[-1] not in _HEAD_SIZES:
        return None
    module = prefill_kernel()
    if module is None:
        return None
    t, heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    grouped = query.reshape(t, kv_heads, heads // kv_heads, dim).contiguous()
    out = module.paged_prefill(grouped, k_cache, v_cache, block_tables, starts, list(seq_lens),
                               float(scale), int(sliding_window or 0))
    return out.view(t, heads, dim)
