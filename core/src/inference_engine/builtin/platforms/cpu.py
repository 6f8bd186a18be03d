"""The CPU platform: always present, lowest priority."""

from __future__ import annotations

import os

import torch

from inference_engine.interfaces.platform import Platform

__all__ = ["CpuPlatform"]


def _meminfo() -> tuple[int, int]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return (0, 0)
    return (values.get("MemAvailable", 0), values.get("MemTotal", 0))


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0

    @classmethod
    def is_present(cls) -> bool:
        return True

    def device_name(self, index: int = 0) -> str:
        return f"cpu ({os.cpu_count()} cores)"

    def memory_info(self) -> tuple[int, int]:
        return _meminfo()

    def supported_dtypes(self) -> list[torch.dtype]:
        # float16 works but is ~1000x slower than bfloat16 on most CPUs.
        return [torch.float32, torch.bfloat16, torch.float16]

    def set_up_process(self) -> None:
        # Denormals slow tiny fp32 models several-fold.
        torch.set_flush_denormal(True)
