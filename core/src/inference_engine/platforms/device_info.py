"""Where platforms get their device facts: torch's runtime, or a simulated machine.

A :class:`~inference_engine.interfaces.platform.Platform` never calls
``torch.cuda.get_device_properties`` itself; it asks the
:class:`DeviceInfoSource` of its kind (``"cuda"``, ``"rocm"``, ``"xpu"``,
``"cpu"``). Normally that source reads torch; inside :func:`simulate_devices`
(or with ``INFERENCE_ENGINE_SIMULATED_DEVICES`` set) every kind answers from a
list of :class:`DeviceProperties` instead, so tests and ``inference-engine env``
can describe an H100, an MI300X or an Arc GPU on a CPU-only machine without
patching torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from inference_engine.platforms.device_properties import (
    DeviceInfoSource,
    DeviceProperties,
    SimulatedDeviceInfo,
)
from inference_engine.platforms.simulated_devices import machine_from_spec

__all__ = [
    "CpuDeviceInfo",
    "DeviceInfoSource",
    "DeviceProperties",
    "SimulatedDeviceInfo",
    "TorchCudaDeviceInfo",
    "device_info_for",
    "is_simulated",
    "simulate_devices",
    "triton_has_backend",
]


class TorchCudaDeviceInfo(DeviceInfoSource):
    """``torch.cuda`` devices of one vendor: NVIDIA (``hip=False``) or AMD ROCm (``hip=True``)."""

    def __init__(self, hip: bool) -> None:
        self.hip = hip

    def _runtime_matches(self) -> bool:
        import torch

        return (torch.version.hip is not None) == self.hip

    def device_count(self) -> int:
        import torch

        if not self._runtime_matches():
            return 0
        try:
            return torch.cuda.device_count() if torch.cuda.is_available() else 0
        except RuntimeError:  # driver present but broken: report no devices
            return 0

    def properties(self, index: int) -> DeviceProperties:
        import torch

        p = torch.cuda.get_device_properties(index)
        return DeviceProperties(
            name=p.name,
            total_memory=int(p.total_memory),
            capability=(int(p.major), int(p.minor)),
            arch=str(getattr(p, "gcnArchName", "") or ""),
            shared_memory_per_block=int(getattr(p, "shared_memory_per_block_optin", 0) or 0),
            multiprocessor_count=int(getattr(p, "multi_processor_count", 0) or 0),
        )

    def memory_info(self, index: int) -> tuple[int, int]:
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return (int(free), int(total))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


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


class CpuDeviceInfo(DeviceInfoSource):
    """The host CPU as one device; always present, also on simulated machines."""

    def device_count(self) -> int:
        return 1

    def properties(self, index: int) -> DeviceProperties:
        free, total = _meminfo()
        return DeviceProperties(
            name=f"{_cpu_name()} ({os.cpu_count()} cores)",
            total_memory=total,
            free_memory=free,
            multiprocessor_count=os.cpu_count() or 1,
        )

    def memory_info(self, index: int) -> tuple[int, int]:
        return _meminfo()


def triton_has_backend(backend: str) -> bool:
    """Whether the installed Triton can compile for ``backend`` ("nvidia", "amd", "intel")."""
    import importlib.util

    try:
        return importlib.util.find_spec(f"triton.backends.{backend}") is not None
    except (ImportError, ValueError):  # no triton at all
        return False


# --------------------------------------------------------------------------- #
# Which source a kind uses.
# --------------------------------------------------------------------------- #

_LOCK = threading.Lock()
_REAL: dict[str, DeviceInfoSource] = {}
# kind -> simulated source while a simulation is active (kinds not listed have no devices).
_SIMULATED: dict[str, DeviceInfoSource] | None = None
_ENV_CHECKED = False


def _simulation() -> dict[str, DeviceInfoSource] | None:
    global _ENV_CHECKED, _SIMULATED
    if not _ENV_CHECKED:
        _ENV_CHECKED = True
        from inference_engine.config import simulated_devices_from_env

        spec = simulated_devices_from_env()
        if spec is not None and _SIMULATED is None:
            _SIMULATED = dict(machine_from_spec(spec))
    return _SIMULATED


def device_info_for(kind: str, real: Callable[[], DeviceInfoSource]) -> DeviceInfoSource:
    """The source a platform of ``kind`` reads; ``real`` builds the torch-backed one.

    Under a simulation, a kind the simulated machine lacks has no devices,
    except ``"cpu"``, which is always the real host.
    """
    simulated = _simulation()
    if simulated is not None and kind != "cpu":
        return simulated.get(kind) or SimulatedDeviceInfo(())
    with _LOCK:
        source = _REAL.get(kind)
        if source is None:
            source = _REAL[kind] = real()
    return source


def is_simulated() -> bool:
    """Whether device facts come from a simulated machine right now."""
    return _simulation() is not None


@contextmanager
def simulate_devices(
    machine: dict[str, Sequence[DeviceProperties] | DeviceInfoSource] | None = None,
) -> Iterator[None]:
    """Make platforms see ``machine`` ({kind: devices}) instead of the real hardware.

    ``simulate_devices({})`` is a CPU-only machine. Nests; restores on exit.
    """
    global _SIMULATED
    previous = _simulation()
    sources: dict[str, DeviceInfoSource] = {}
    for kind, devices in (machine or {}).items():
        sources[kind] = (
            devices if isinstance(devices, DeviceInfoSource) else SimulatedDeviceInfo(devices)
        )
    _SIMULATED = sources
    try:
        yield
    finally:
        _SIMULATED = previous
