"""What a device reports about itself, and the source interface platforms read it through.

The lowest layer of device facts: :mod:`device_info` picks a source per kind
(torch's runtime or a simulated machine), and :mod:`simulated_devices` names
published profiles built from these records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["DeviceInfoSource", "DeviceProperties", "SimulatedDeviceInfo"]


@dataclass(frozen=True)
class DeviceProperties:
    """The facts one device reports about itself."""

    name: str
    total_memory: int
    # CUDA compute capability (ROCm builds of torch report one too; it is not used there).
    capability: tuple[int, int] | None = None
    # Architecture as the runtime names it: ROCm ``gcnArchName`` ("gfx942:sramecc+:xnack-").
    arch: str = ""
    # Free bytes; None: report 95% of total (simulated devices) or ask the runtime.
    free_memory: int | None = None
    # Shared memory (LDS on AMD) a kernel block may use, in bytes; 0 if unknown.
    shared_memory_per_block: int = 0
    multiprocessor_count: int = 0
    # Capability flags the runtime reports ("fp64", "bf16", "xmx" on XPU).
    features: frozenset[str] = field(default_factory=frozenset)


class DeviceInfoSource(ABC):
    """The devices of one kind visible to this process (after ``*_VISIBLE_DEVICES``)."""

    simulated: bool = False

    @abstractmethod
    def device_count(self) -> int:
        """Visible devices of this kind; 0 when the runtime or hardware is absent."""

    @abstractmethod
    def properties(self, index: int) -> DeviceProperties:
        """Facts of visible device ``index`` (0-based)."""

    def memory_info(self, index: int) -> tuple[int, int]:
        """(free, total) bytes of visible device ``index``."""
        props = self.properties(index)
        free = props.free_memory if props.free_memory is not None else props.total_memory
        return (free, props.total_memory)


class SimulatedDeviceInfo(DeviceInfoSource):
    """A fixed list of devices; nothing touches torch's runtime."""

    simulated = True

    def __init__(self, devices: Sequence[DeviceProperties] = ()) -> None:
        self.devices = list(devices)

    def device_count(self) -> int:
        return len(self.devices)

    def properties(self, index: int) -> DeviceProperties:
        return self.devices[index]

    def memory_info(self, index: int) -> tuple[int, int]:
        props = self.devices[index]
        free = props.free_memory
        if free is None:
            free = int(props.total_memory * 0.95)
        return (free, props.total_memory)
