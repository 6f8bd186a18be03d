"""A C++ CPU kernel that multiplies float32 activations by raw GGML blocks, fused.

``y[M, N] = x[M, K] @ W.T`` where ``W [N, K]`` is held as GGML rows
(``uint8 [N, row_bytes]``). Each thread takes tiles of a few output rows,
dequantizes just those rows into a small float32 buffer that stays in cache and
multiplies it with all ``M`` activation rows before the next tile: the dense
weight never exists in memory, and each weight byte is read once per matmul
whatever ``M`` is. The torch path (:func:`inference_engine_gguf.dequant.dequantize`
+ ``F.linear``) is the reference it is tested against.

The dequantization is ggml's own ``dequantize_row_*`` arithmetic, built with
``-ffp-contract=off`` so that it equals the torch path (and ``gguf.quants``) bit
for bit; the dot products use AVX-512 FMAs when the compiler targets AVX-512F
(plain loops otherwise), so results differ from ``F.linear`` by float32
summation order only. :func:`dequantize_rows` exposes the dequantization alone
(the quantized embedding's row lookup).

The C++ is ``csrc/ggml_matmul.cpp`` (with ``csrc/ggml_helpers.h``), built on first use by
:func:`load_ggml_extension`; wherever that is impossible, or
``INFERENCE_ENGINE_CPU_KERNELS=0``, :func:`kernel` is None and callers keep the torch path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from gguf.constants import GGMLQuantizationType
from inference_engine.cpu_extensions import CSRC_DIR as CORE_CSRC_DIR
from inference_engine.cpu_extensions import CpuKernelBuild, extension_name
from inference_engine.cpu_thread_pool import load_pooled_sources

__all__ = ["CSRC_DIR", "GGML_CFLAGS", "GGML_MATMUL_BUILD", "ggml_build", "KERNEL_TYPES", "dequantize", "dequantize_rows",
           "ggml_extension_name", "ggml_linear", "kernel", "load_ggml_extension", "supports"]

T = GGMLQuantizationType

# GGML block types the kernel handles (everything else keeps the torch path).
KERNEL_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
})

# Activation rows from which dequantize-a-tile + ``F.linear`` beats the fused kernel.
DENSE_MIN_ROWS = 256
# Dense values one dequantized tile may hold on that path (16 MiB of float32).
DENSE_TILE_VALUES = 1 << 22

CSRC_DIR: Path = Path(__file__).resolve().parent / "csrc"
"""The plugin's C++: ``ggml_matmul.cpp`` (this kernel), ``q8k_matmul.cpp``
(:mod:`inference_engine_gguf.q8k_kernels`) and the header they share, ``ggml_helpers.h``
(``f16``, ``q3k_scales``, ``scale_min_k4``). They also include the core's
``ie_parallel_tasks.h`` (:data:`inference_engine.cpu_extensions.CSRC_DIR`)."""

# NOTE: no FMA contraction, so scales and dequantized values round exactly as ggml's C
# (and gguf.quants) do.
GGML_CFLAGS: tuple[str, ...] = ("-ffp-contract=off",)

_STEM = "inference_engine_gguf_ggml_matmul"
_SOURCES = [str(CSRC_DIR / "ggml_matmul.cpp")]


def ggml_build(stem: str, sources: Sequence[str], description: str,
               extra_cflags: tuple[str, ...] = ()) -> CpuKernelBuild:
    """What :func:`load_ggml_extension` builds, for
    :func:`inference_engine.cpu_extensions.build_cpu_extensions` (same name, same cache)."""
    return CpuKernelBuild(stem, tuple(map(str, sources)), description,
                          (*GGML_CFLAGS, *extra_cflags))


GGML_MATMUL_BUILD = ggml_build(_STEM, _SOURCES, "the CPU GGML block matmul kernel")


def load_ggml_extension(stem: str, sources: list[str], *, description: str,
                        extra_cflags: tuple[str, ...] = ()) -> Any | None:
    """A GGML kernel built from ``sources`` with :data:`GGML_CFLAGS`: the module, or None.

    :func:`inference_engine.cpu_thread_pool.load_pooled_sources`: built on first use
    under :func:`ggml_extension_name` and pointed at the core's thread pool; None when
    the build fails or ``INFERENCE_ENGINE_CPU_KERNELS=0``. Called on every kernel call
    (a built module is found with a few dict lookups).

    Args:
        stem: the kernel's name; each variant (other ``extra_cflags``) needs its own.
        sources: paths of the ``.cpp`` files (in :data:`CSRC_DIR`).
        description: names the kernel in the log lines.
        extra_cflags: flags beyond :data:`GGML_CFLAGS` (``-DNAME=...``, ``-mno-...``).
    """
    return load_pooled_sources(stem, sources, description=description,
                               extra_cflags=(*GGML_CFLAGS, *extra_cflags))


def ggml_extension_name(stem: str, sources: list[str | os.PathLike[str]], *,
                        extra_cflags: tuple[str, ...] = (),
                        flags: Sequence[str] | None = None) -> str:
    """The name :func:`load_ggml_extension` builds and caches ``sources`` under.

    ``{stem}_{isa}_{content}``: a hash of the CPU's instruction-set ``flags`` (None: this
    machine's) and one of the flags and every source and header it includes (found beside
    the source, then in the core's ``csrc``), so any edit to them means a new build.
    """
    return extension_name(stem, sources, include_dirs=[CORE_CSRC_DIR],
                          extra_cflags=(*GGML_CFLAGS, *extra_cflags), flags=flags)


def kernel() -> Any | None:
    """The compiled extension, or None where it cannot be built or is turned off."""
    return load_ggml_extension(_STEM, _SOURCES, description=GGML_MATMUL_BUILD.description)


def supports(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType) -> bool:
    """Whether :func:`ggml_linear` handles this call (CPU, float32, a kernel type)."""
    return (qtype in KERNEL_TYPES and x.device.type == "cpu" and raw.device.type == "cpu"
            and x.dtype == torch.float32 and raw.dtype == torch.uint8)


def ggml_linear(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """``x [..., K] @ dequantize(raw).T`` -> float32 ``[..., N]``, ``raw`` ``uint8 [N, row_bytes]``.

    From :data:`DENSE_MIN_ROWS` activation rows on (prefill), tiles of weight rows
    are dequantized by the kernel and multiplied by ``F.linear``, whose GEMM
    beats the kernel's dot products once the dequantization is spread over that
    many rows.

    Raises:
        RuntimeError: if the kernel is unavailable (check :func:`kernel` first).
    """
    ext = kernel()
    if ext is None:
        raise RuntimeError("the CPU GGML block matmul kernel is not available")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    raw = raw.contiguous()
    if x2.shape[0] < DENSE_MIN_ROWS:
        y = ext.ggml_linear(x2, raw, int(qtype))
    else:
        n = raw.shape[0]
        y = x2.new_empty(x2.shape[0], n)
        tile_rows = max(1, DENSE_TILE_VALUES // max(k, 1))
        for start in range(0, n, tile_rows):
            stop = min(n, start + tile_rows)
            dense = ext.ggml_dequantize(raw[start:stop], int(qtype))  # [rows, K]
            y[:, start:stop] = torch.mm(x2, dense.t())
    return y.reshape(*lead, y.shape[-1])


def dequantize_rows(raw: torch.Tensor, ids: torch.Tensor,
                    qtype: GGMLQuantizationType) -> torch.Tensor:
    """Rows ``ids [T]`` of ``raw [V, row_bytes]`` dequantized to float32 ``[T, K]``.

    Raises:
        RuntimeError: if the kernel is unavailable, or an id is out of range.
    """
    ext = kernel()
    if ext is None:
        raise RuntimeError("the CPU GGML block matmul kernel is not available")
    return ext.ggml_dequantize_rows(raw.contiguous(), ids.long(), int(qtype))


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Every row of ``raw [..., row_bytes]`` dequantized to float32 ``[..., K]``.

    Bit for bit equal to :func:`inference_engine_gguf.dequant.dequantize`.

    Raises:
        RuntimeError: if the kernel is unavailable (check :func:`kernel` first).
    """
    ext = kernel()
    if ext is None:
        raise RuntimeError("the CPU GGML block matmul kernel is not available")
    lead = raw.shape[:-1]
    values = ext.ggml_dequantize(raw.reshape(-1, raw.shape[-1]).contiguous(), int(qtype))
    return values.reshape(*lead, values.shape[-1])
