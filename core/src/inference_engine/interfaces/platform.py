"""What a device can do; everything reads device facts through a Platform."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

__all__ = ["Platform"]


class Platform(ABC):
    """A hardware platform. Subclasses answer questions; callers never branch on names."""

    # Registration name (``--platform``).
    name: ClassVar[str] = ""
    # torch device type ("cpu", "cuda", "xpu").
    device_type: ClassVar[str] = "cpu"
    # Among present platforms the highest priority is chosen.
    priority: ClassVar[int] = 0

    def __init__(self, device_ids: list[int] | None = None) -> None:
        self.device_ids = list(device_ids) if device_ids else [0]

    @classmethod
    @abstractmethod
    def is_present(cls) -> bool:
        """Whether this platform's hardware (and its torch build) is usable here."""

    def device(self, rank: int = 0) -> torch.device:
        """The torch device for a worker rank, honouring ``--device-ids``."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.device_ids[rank])

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int = 0) -> str:
        return self.name

    def arch_name(self) -> str:
        """Architecture string (``sm90``, ``gfx942``); empty where meaningless."""
        return ""

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the first selected device."""
        return (0, 0)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def fp8_dtype(self) -> torch.dtype | None:
        """The FP8 E4M3 flavour this device computes with, or None without FP8 math."""
        return None

    def supports_fp4(self) -> bool:
        return False

    def attention_backends(self) -> list[str]:
        """Attention backend names this platform can run, best first."""
        return ["paged", "torch_sdpa"]

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype to compute in when the model asks for ``dtype`` (a slow one may be widened)."""
        return dtype

    def set_up_process(self) -> None:
        """Per-process numeric settings (flush denormals, ...); called at engine start."""

    def kernel_tuning_default(self, op_name: str, shape: dict[str, int]) -> dict[str, Any] | None:
        """Fallback tuning answer when no plugin answers ``ie_kernel_tuning_config``."""
        return None
