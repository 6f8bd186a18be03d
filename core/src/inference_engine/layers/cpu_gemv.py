"""CPU linear layers of bfloat16 checkpoints: a bf16 copy of the widened weights.

The CPU platform computes bfloat16 checkpoints in float32
(``Platform.compute_dtype``): activations, norms and attention are float32
(the KV cache stays bfloat16, ``--kv-cache-dtype auto``), and each linear
layer keeps an exact bfloat16 copy of its weight
(only made when every float32 value is a bfloat16 value) that it multiplies
from:

* every copy whose shape allows it (``N % 16 == 0``, even ``K``) is *packed*,
  ``[N/16, K/2, 16, 2]``: one 64-byte vector per 16 output columns and pair of
  ``k``, so outputs accumulate 16 columns per register with no horizontal sums,
  and a pair is exactly what ``vdpbf16ps`` multiplies;
* decode-sized batches (up to :func:`gemv_max_rows` rows) go through a GEMV
  kernel: it reads 2 bytes per weight, widens them to float32 in registers
  and accumulates float32 activations in float32;
* larger batches, on CPUs with a bf16 dot product (AVX512-BF16, AMX) and
  when bfloat16 was asked for (:func:`allow_bf16_gemm`), multiply with the
  activations rounded to bf16 (as llama.cpp and transformers compute bf16
  models) in the packed ``vdpbf16ps`` kernel on the core's spinning pool,
  float32 sums and results; a row-major copy (a shape the packing does not
  take) uses oneDNN's bf16 GEMM instead. Elsewhere, and for
  ``dtype=float32``, MKL's GEMM on the float32 weights.

Timings against ``F.linear`` and oneDNN are in ``docs/benchmarks.md`` ("CPU
kernel timings"). The float32 weight stays (the reference path, and the MKL
path), so the copy costs half as much memory again as the float32 weights.

AVX-512, or AVX2 with FMA (8-float vectors, smaller register tiles: one row
of up to four groups, or up to four rows of one group); other CPUs keep
``F.linear``. ``INFERENCE_ENGINE_CPU_KERNELS=0`` turns it off. ``F.linear`` in float64
is the reference it is tested against.
The C++ is ``csrc/cpu_gemv.cpp``, built on first use by
:mod:`inference_engine.cpu_extensions`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inference_engine.builtin.platforms import cpu as cpu_platform
from inference_engine.cpu_extensions import CpuKernelBuild
from inference_engine.cpu_thread_pool import load_pooled_build

__all__ = ["GEMV_BUILD", "GEMV_MAX_ROWS", "NATIVE_BF16_GEMV_MAX_ROWS", "allow_bf16_gemm",
           "bf16_gemv_weight", "gemv_kernel", "gemv_max_rows", "is_packed", "small_batch_linear",
           "unpack_bf16"]

GEMV_MAX_ROWS = 24
"""Largest number of activation rows sent to the kernel instead of MKL's float32 GEMM."""
NATIVE_BF16_GEMV_MAX_ROWS = 8
"""The same limit where oneDNN's bf16 GEMM (a CPU with a bf16 dot product) is the alternative."""


GEMV_BUILD = CpuKernelBuild("inference_engine_cpu_gemv", ("cpu_gemv.cpp",),
                            "the CPU bf16 GEMV kernel")


def gemv_kernel() -> Any | None:
    """The compiled module, or None where it cannot be built or the CPU lacks AVX-512 and AVX2."""
    module = load_pooled_build(GEMV_BUILD)
    if module is None or not module.available():
        return None
    return module


def gemv_max_rows() -> int:
    """Rows up to which the GEMV kernel beats this CPU's GEMM."""
    return NATIVE_BF16_GEMV_MAX_ROWS if cpu_platform.has_native_bf16() else GEMV_MAX_ROWS


def bf16_gemv_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An exact bfloat16 copy of a float32 CPU ``[N, K]`` weight, or None.

    Packed (:func:`is_packed`, ``[N/16, K/2, 16, 2]``, the kernels' layout) where
    the kernel is built and ``N % 16 == 0`` and ``K`` is even; otherwise a
    contiguous ``[N, K]`` copy. None unless the copy is exact (every value is a
    bfloat16 value, as it is for a bfloat16 checkpoint widened to float32) and
    something uses it: the kernels, or the CPU's bf16 GEMM.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    module = gemv_kernel()
    if module is None and not cpu_platform.has_native_bf16():
        return None
    copy = weight.detach().to(torch.bfloat16).contiguous()
    if not torch.equal(copy.to(torch.float32), weight):
        return None
    if module is not None and copy.shape[0] % 16 == 0 and copy.shape[1] % 2 == 0:
        return module.pack_bf16(copy)
    return copy


def is_packed(gemv_weight: torch.Tensor) -> bool:
    """Whether a :func:`bf16_gemv_weight` copy is in the kernels' packed layout."""
    return gemv_weight.dim() == 4


def unpack_bf16(gemv_weight: torch.Tensor) -> torch.Tensor:
    """The ``[N, K]`` bfloat16 matrix of a :func:`bf16_gemv_weight` copy (either layout)."""
    if not is_packed(gemv_weight):
        return gemv_weight
    groups, pairs = gemv_weight.shape[:2]
    return gemv_weight.permute(0, 2, 1, 3).reshape(groups * 16, pairs * 2)


def allow_bf16_gemm(model: torch.nn.Module) -> None:
    """Let the layers of a model loaded as bfloat16 multiply large batches in bf16."""
    for module in model.modules():
        if getattr(module, "gemv_weight", None) is not None:
            module.bf16_gemm = True


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, gemv_weight: torch.Tensor | None,
                       bias: torch.Tensor | None = None, *,
                       bf16_gemm: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 ``x``, from the bf16 copy where there is one.

    Up to :func:`gemv_max_rows` rows go through the GEMV kernel (float32
    activations); more go, with ``bf16_gemm`` on a CPU with a bf16 dot
    product, to the packed ``vdpbf16ps`` kernel (activations rounded to bf16,
    as a bf16 model computes; float32 sums) or, for an unpacked copy, to
    oneDNN's bf16 GEMM; else to ``F.linear`` on the float32 weight.
    """
    if gemv_weight is None or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    packed = is_packed(gemv_weight)
    if x.dim() == 2 and 0 < x.shape[0] <= gemv_max_rows():
        module = gemv_kernel()
        if module is not None:
            if packed:
                return module.gemv_packed(x if x.stride(-1) == 1 else x.contiguous(),
                                          gemv_weight, bias)
            return module.gemv(x.contiguous(), gemv_weight, bias)
    if bf16_gemm and cpu_platform.has_native_bf16():
        module = gemv_kernel()
        if packed and x.dim() == 2 and module is not None and module.has_dpbf16():
            return module.gemm_packed(x.contiguous(), gemv_weight, bias)
        out = F.linear(x.to(torch.bfloat16), unpack_bf16(gemv_weight)).float()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
