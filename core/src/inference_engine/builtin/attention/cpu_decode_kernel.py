"""C++ decode attention for CPU that reads K/V blocks where they lie, and the cache write.

The torch path of the paged backend gathers every decode's blocks into a
contiguous buffer and then runs SDPA over it: the cache is read, written and
read again. This kernel walks each sequence's block table and reads each K
and V row once (once for all the query heads that share it), which is what
bounds batched decode on a CPU. It goes over the blocks in
one pass (a block's keys, then its values, which lie next to each other in the
pool) with an online softmax, prefetching the next blocks: the blocks of a
sequence lie scattered, a few KB each, which the hardware prefetcher does not
follow. With AVX-512 or AVX2 + FMA the scores, the softmax (a polynomial exp)
and the weighted sums run 16 lanes wide (one register, or two on AVX2); other
CPUs and head sizes that are not 32/64/128/256 use plain loops.

The cache may be float32 or bfloat16 (a bfloat16 model's cache: half the
bytes to read, widened in registers); queries and outputs are float32.
:func:`write_kv_rows` stores a step's new K/V rows at their slots in either
dtype (bfloat16 rounded to nearest even, as ``Tensor.to`` does), in place of
an advanced-indexing assignment (timings in ``docs/benchmarks.md``, "CPU
kernel timings").

The C++ is ``csrc/cpu_decode_attention.cpp`` (with the shared
``ie_simd_helpers.h`` and ``ie_parallel_tasks.h``), compiled on first use by
:mod:`inference_engine.cpu_extensions` (a C++ compiler and ninja are needed;
cached by torch afterwards); the callers keep the torch path, with one log
line, wherever that is impossible. ``INFERENCE_ENGINE_CPU_KERNELS=0`` never
builds it. No attention sinks. The torch path (gather + SDPA) is the
reference it is tested against.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_engine.cpu_extensions import CpuKernelBuild
from inference_engine.cpu_thread_pool import load_pooled_build

__all__ = ["DECODE_BUILD", "KERNEL_CACHE_DTYPES", "decode_kernel", "paged_decode_attention",
           "reads_cache", "write_kv_rows"]

# Cache dtypes the kernels read and write.
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def reads_cache(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """What the decode and prefill kernels share: float32 queries on CPU, a cache of
    :data:`KERNEL_CACHE_DTYPES` in blocks of at most 16 tokens."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and k_cache.dtype in KERNEL_CACHE_DTYPES and k_cache.shape[1] <= 16)


DECODE_BUILD = CpuKernelBuild("inference_engine_cpu_decode", ("cpu_decode_attention.cpp",),
                              "the CPU paged-decode attention kernel")


def decode_kernel() -> Any | None:
    """The compiled extension module, or None where it cannot be built (logged once)."""
    return load_pooled_build(DECODE_BUILD)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """``[n, heads, head_dim]`` decode attention read in place, or None to use the torch path.

    Args:
        query: ``[n, heads, head_dim]`` float32, one query per sequence.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` layer views,
            float32 or bfloat16.
        block_tables: ``[n, >= blocks in use]`` int64.
        seq_lens: ``[n]`` int64 context lengths including the new token.
    """
    if not reads_cache(query, k_cache) or query.shape[1] > 256:
        return None
    module = decode_kernel()
    if module is None:
        return None
    n, heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    grouped = query.reshape(n, kv_heads, heads // kv_heads, dim).contiguous()
    out = module.paged_decode(grouped, k_cache, v_cache, block_tables, seq_lens, float(scale),
                              int(sliding_window or 0))
    return out.view(n, heads, dim)


def write_kv_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Store ``key``/``value [T, kv_heads, head_dim]`` at ``(blocks[i], offsets[i])``.

    Returns False (nothing written) where the kernel does not apply: not CPU,
    not float32 rows, a cache dtype it does not handle, or no kernel.
    """
    if (key.device.type != "cpu" or key.dtype != torch.float32 or value.dtype != torch.float32
            or k_cache.dtype not in KERNEL_CACHE_DTYPES or key.stride(-1) != 1
            or value.stride(-1) != 1 or blocks.dtype != torch.int64):
        return False
    module = decode_kernel()
    if module is None:
        return False
    module.write_kv(k_cache, v_cache, key, value, blocks.contiguous(), offsets.contiguous())
    return True
