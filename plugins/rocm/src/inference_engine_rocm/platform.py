"""The AMD ROCm platform: torch's HIP build, devices named by ``gcnArchName``.

Architecture facts it answers (``arch_name()`` is the part of ``gcnArchName``
before the first colon):

=========  ===================  =======================  =====
arch       devices              FP8 math                 FP4
=========  ===================  =======================  =====
gfx90a     MI210, MI250(X)      none                     no
gfx942     MI300X/A, MI325X     float8_e4m3fnuz (max 240) no
gfx950     MI350X, MI355X       float8_e4m3fn (OCP)      yes
gfx12xx    Radeon RX 9000       float8_e4m3fn (OCP)      no
=========  ===================  =======================  =====

On gfx942 an e4m3fn checkpoint is run by reinterpreting its bytes as
e4m3fnuz (the bit pattern 0x80, -0 in e4m3fn and NaN in e4m3fnuz, becomes 0)
and doubling its scales: :meth:`fp8_scale_adjustment` returns that 2.0.
"""

from __future__ import annotations

import torch
from inference_engine.builtin.platforms.cuda import TorchCudaRuntime
from inference_engine.interfaces.platform import (
    KERNEL_SCALED_MM_FP8,
    KERNEL_TRITON_FP8,
    KERNEL_TRITON_FP8_BLOCK,
    KERNEL_TRITON_MXFP4,
)
from inference_engine.platforms.device_info import (
    DeviceInfoSource,
    TorchCudaDeviceInfo,
    triton_has_backend,
)

__all__ = ["RocmPlatform", "base_arch"]

# Architectures with OCP e4m3fn FP8 math; gfx942 has the fnuz flavour instead.
_OCP_FP8_ARCHS = ("gfx950", "gfx1200", "gfx1201")
_FNUZ_FP8_ARCHS = ("gfx940", "gfx941", "gfx942")
_FP4_ARCHS = ("gfx950",)


def base_arch(gcn_arch_name: str) -> str:
    """``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"``."""
    return gcn_arch_name.split(":", 1)[0].strip()


class RocmPlatform(TorchCudaRuntime):
    """AMD GPUs through torch's HIP build: the CUDA runtime's streams, HIP graphs, events."""

    name = "rocm"
    # torch's HIP build keeps the "cuda" device type.
    device_type = "cuda"
    priority = 10
    device_info_kind = "rocm"
    # HIP honours all three; the engine sets none of them.
    visible_devices_env_vars = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                                "CUDA_VISIBLE_DEVICES")

    @classmethod
    def make_device_info(cls) -> DeviceInfoSource:
        return TorchCudaDeviceInfo(hip=True)

    @classmethod
    def absence_reason(cls) -> str:
        if cls.device_info().simulated:
            return "the simulated machine has no AMD GPU"
        if torch.version.hip is None:
            return f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"
        return "torch.cuda.is_available() is False on this ROCm build (no GPU or no driver)"

    def arch_name(self) -> str:
        return base_arch(self.properties().arch)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def fp8_dtype(self) -> torch.dtype | None:
        arch = self.arch_name()
        if arch in _FNUZ_FP8_ARCHS:
            return torch.float8_e4m3fnuz
        if arch in _OCP_FP8_ARCHS:
            return torch.float8_e4m3fn
        return None

    def supports_fp4(self) -> bool:
        return self.arch_name() in _FP4_ARCHS

    def supports_triton(self) -> bool:
        return triton_has_backend("amd")

    def fp8_gemm_kernels(self) -> list[str]:
        if self.fp8_dtype() is None:
            return []
        kernels = [KERNEL_SCALED_MM_FP8]  # hipBLASLt
        if self.supports_triton():
            kernels += [KERNEL_TRITON_FP8, KERNEL_TRITON_FP8_BLOCK]
        return kernels

    def fp4_gemm_kernels(self) -> list[str]:
        if not (self.supports_fp4() and self.supports_triton()):
            return []
        return [KERNEL_TRITON_MXFP4]

    def describe(self) -> dict:
        described = super().describe()
        described["gcn_arch_name"] = self.properties().arch
        described["lds_per_block"] = self.properties().shared_memory_per_block
        from inference_engine_rocm.tuning import shipped_tables

        described["tuning_tables"] = [f"{arch}/{op}" for arch, op in shipped_tables()
                                      if arch == self.arch_name()]
        return described
