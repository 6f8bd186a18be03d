"""The CPU platform: always present, lowest priority."""

from __future__ import annotations

from functools import cache

import torch

from inference_engine.cpu_extensions import CpuKernelBuild, cpu_isa_flags
from inference_engine.interfaces.platform import KERNEL_INT8_MM, Platform

__all__ = ["CpuPlatform", "cpu_kernel_builds"]


def _keep_large_allocations_on_heap() -> None:
    """Serve multi-MB activations from glibc's heap instead of fresh mmaps.

    Every step allocates the same large temporaries; as mmaps each one is
    page-faulted in again (measured: 4x the cost of the copy filling it).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
        libc.mallopt(m_trim_threshold, 256 << 20)
    except (OSError, AttributeError):
        pass  # not glibc: keep the allocator's defaults


@cache
def has_native_bf16() -> bool:
    """Whether the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), from the
    flags the kernel builds are keyed by; assumed where they cannot be read (the bf16 paths
    are then taken: correct, only slow without the instructions)."""
    flags = cpu_isa_flags()
    if not flags:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_kernel_builds() -> list[CpuKernelBuild]:
    """The core's C++ CPU kernels, slowest build first (the whole-step decode kernel and
    prefill attention take longest), so side by side they finish together."""
    from inference_engine.builtin.attention.cpu_decode_kernel import DECODE_BUILD
    from inference_engine.builtin.attention.cpu_prefill_kernel import PREFILL_BUILD
    from inference_engine.cpu_thread_pool import POOL_BUILD
    from inference_engine.layers.cpu_decode_step import DECODE_STEP_BUILD
    from inference_engine.layers.cpu_fused import FUSED_BUILD
    from inference_engine.layers.cpu_gemv import GEMV_BUILD

    return [DECODE_STEP_BUILD, PREFILL_BUILD, DECODE_BUILD, GEMV_BUILD, FUSED_BUILD, POOL_BUILD]


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0

    device_info_kind = "cpu"

    @classmethod
    def is_present(cls) -> bool:
        return True

    def arch_name(self) -> str:
        import platform

        return platform.machine()

    def supported_dtypes(self) -> list[torch.dtype]:
        # float16 works but is ~1000x slower than bfloat16 on most CPUs.
        return [torch.float32, torch.bfloat16, torch.float16]

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # bf16 weights are exact in fp32, so bf16 checkpoints compute there: without
        # bf16 instructions oneDNN emulates bf16 matmuls at about a quarter of the fp32
        # rate, and with them bf16 element-wise ops, norms and attention are slower
        # than fp32 ones. The linear layers still read a bf16 copy of their weights
        # (inference_engine.layers.cpu_gemv), with the CPU's bf16 GEMM where it has one.
        if dtype == torch.bfloat16:
            return torch.float32
        return dtype

    def set_up_process(self) -> None:
        # Denormals slow tiny fp32 models several-fold.
        torch.set_flush_denormal(True)
        _keep_large_allocations_on_heap()

    def build_kernels(self) -> float:
        from inference_engine.cpu_extensions import build_cpu_extensions

        return build_cpu_extensions(cpu_kernel_builds())

    def attention_backends(self) -> list[str]:
        # cpu_paged: the C++ kernels over the paged pool; torch_sdpa: the reference.
        return ["cpu_paged", "torch_sdpa"]

    def fused_op_kernels(self) -> list[str]:
        return ["cpu", "torch"]

    def int_gemm_kernels(self) -> list[str]:
        # oneDNN's int8 GEMM: exact, and several times the fp32 matmul's rate.
        return [KERNEL_INT8_MM]

    def supports_triton(self) -> bool:
        # Triton has no CPU code generator; TRITON_INTERPRET=1 (tests) is not a backend.
        return False
