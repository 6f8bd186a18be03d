"""The Intel XPU platform: torch's ``torch.xpu`` devices (Data Center GPU Max, Arc).

No Intel GPU in this family computes in FP8 or FP4 through torch, so FP8/FP4
checkpoints run by dequantizing to bf16; bf16 and fp16 run on the XMX engines.
Device ids index the devices left visible by ``ZE_AFFINITY_MASK`` /
``ONEAPI_DEVICE_SELECTOR`` (the engine sets neither).
"""

from __future__ import annotations

import torch
from inference_engine.interfaces.platform import Platform
from inference_engine.platforms.device_info import (
    DeviceInfoSource,
    DeviceProperties,
    triton_has_backend,
)

__all__ = ["TorchXpuDeviceInfo", "XpuPlatform"]


def _xpu_module():
    return getattr(torch, "xpu", None)


class TorchXpuDeviceInfo(DeviceInfoSource):
    """``torch.xpu`` devices; absent on torch builds without XPU support."""

    def device_count(self) -> int:
        xpu = _xpu_module()
        try:
            return xpu.device_count() if xpu is not None and xpu.is_available() else 0
        except RuntimeError:
            return 0

    def properties(self, index: int) -> DeviceProperties:
        p = torch.xpu.get_device_properties(index)
        features = {
            flag for flag, attr in (("fp16", "has_fp16"), ("fp64", "has_fp64"),
                                    ("bf16", "has_bfloat16_conversions"),
                                    ("xmx", "has_subgroup_matrix_multiply_accumulate"))
            if getattr(p, attr, False)
        }
        return DeviceProperties(
            name=str(p.name),
            total_memory=int(p.total_memory),
            multiprocessor_count=int(getattr(p, "gpu_eu_count", 0) or 0),
            features=frozenset(features),
        )

    def memory_info(self, index: int) -> tuple[int, int]:
        mem_get_info = getattr(torch.xpu, "mem_get_info", None)
        if mem_get_info is not None:
            free, total = mem_get_info(index)
            return (int(free), int(total))
        total = self.properties(index).total_memory
        return (total - int(torch.xpu.memory_reserved(index)), total)


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    # Below CUDA/ROCm: a machine with both an NVIDIA GPU and an Arc iGPU picks the NVIDIA one.
    priority = 5
    device_info_kind = "xpu"
    visible_devices_env_vars = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")

    @classmethod
    def make_device_info(cls) -> DeviceInfoSource:
        return TorchXpuDeviceInfo()

    @classmethod
    def absence_reason(cls) -> str:
        if cls.device_info().simulated:
            return "the simulated machine has no Intel GPU"
        if _xpu_module() is None:
            return f"torch {torch.__version__} has no torch.xpu module"
        return (f"torch.xpu.is_available() is False (torch {torch.__version__}: an XPU build "
                f"and Intel GPU drivers are needed)")

    def arch_name(self) -> str:
        # torch.xpu exposes no architecture code; the device name is what identifies it.
        return self.properties().name

    def supported_dtypes(self) -> list[torch.dtype]:
        features = self.properties().features
        if not features:  # a torch that reports no capability flags: assume the usual set
            return [torch.bfloat16, torch.float16, torch.float32]
        dtypes = []
        if "bf16" in features or "xmx" in features:
            dtypes.append(torch.bfloat16)
        if "fp16" in features:
            dtypes.append(torch.float16)
        dtypes.append(torch.float32)
        return dtypes

    def supports_triton(self) -> bool:
        # Intel's XPU backend ships as the "triton" distribution pytorch-triton-xpu.
        return triton_has_backend("intel")

    def describe(self) -> dict:
        described = super().describe()
        described["features"] = sorted(self.properties().features)
        return described
