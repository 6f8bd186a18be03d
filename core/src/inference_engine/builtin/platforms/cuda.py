"""The NVIDIA CUDA platform (not ROCm: that build reports torch.version.hip)."""

from __future__ import annotations

import torch

from inference_engine.interfaces.platform import Platform

__all__ = ["CudaPlatform"]


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    priority = 10

    @classmethod
    def is_present(cls) -> bool:
        return torch.version.hip is None and torch.cuda.is_available()

    def device_count(self) -> int:
        return len(self.device_ids)

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(self.device_ids[index])

    def capability(self) -> tuple[int, int]:
        return torch.cuda.get_device_capability(self.device_ids[0])

    def arch_name(self) -> str:
        major, minor = self.capability()
        return f"sm{major}{minor}"

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device_ids[0])

    def supported_dtypes(self) -> list[torch.dtype]:
        major, _ = self.capability()
        dtypes = [torch.float32, torch.float16]
        if major >= 8:
            dtypes.insert(1, torch.bfloat16)
        return dtypes

    def fp8_dtype(self) -> torch.dtype | None:
        return torch.float8_e4m3fn if self.capability() >= (8, 9) else None

    def supports_fp4(self) -> bool:
        return self.capability()[0] >= 10
