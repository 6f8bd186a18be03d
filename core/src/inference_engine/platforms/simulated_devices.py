"""Named device profiles with their vendors' published facts, for simulated machines.

Used by tests and by ``INFERENCE_ENGINE_SIMULATED_DEVICES=h100:2`` (``env`` and
platform selection only; nothing can run on a simulated device). Values are
what each runtime reports: ``major.minor`` from ``torch.cuda.get_device_capability``,
``gcnArchName`` from ``torch.cuda.get_device_properties`` on ROCm, the
``name`` of ``torch.xpu.get_device_properties``.
"""

from __future__ import annotations

from inference_engine.platforms.device_properties import DeviceProperties, SimulatedDeviceInfo

__all__ = ["PROFILES", "machine_from_spec", "profile"]

_GiB = 1 << 30
_KiB = 1 << 10

# name -> (device-info kind, properties)
PROFILES: dict[str, tuple[str, DeviceProperties]] = {
    # ---- NVIDIA: one per capability family the platform distinguishes ----
    "t4": ("cuda", DeviceProperties(
        "Tesla T4", 15 * _GiB, capability=(7, 5), shared_memory_per_block=64 * _KiB,
        multiprocessor_count=40)),
    "a100": ("cuda", DeviceProperties(
        "NVIDIA A100-SXM4-80GB", 80 * _GiB, capability=(8, 0),
        shared_memory_per_block=163 * _KiB, multiprocessor_count=108)),
    "a10": ("cuda", DeviceProperties(
        "NVIDIA A10", 23 * _GiB, capability=(8, 6), shared_memory_per_block=99 * _KiB,
        multiprocessor_count=72)),
    "l4": ("cuda", DeviceProperties(
        "NVIDIA L4", 23 * _GiB, capability=(8, 9), shared_memory_per_block=99 * _KiB,
        multiprocessor_count=58)),
    "rtx4090": ("cuda", DeviceProperties(
        "NVIDIA GeForce RTX 4090", 24 * _GiB, capability=(8, 9),
        shared_memory_per_block=99 * _KiB, multiprocessor_count=128)),
    "h100": ("cuda", DeviceProperties(
        "NVIDIA H100 80GB HBM3", 80 * _GiB, capability=(9, 0),
        shared_memory_per_block=227 * _KiB, multiprocessor_count=132)),
    "h200": ("cuda", DeviceProperties(
        "NVIDIA H200", 141 * _GiB, capability=(9, 0), shared_memory_per_block=227 * _KiB,
        multiprocessor_count=132)),
    "b200": ("cuda", DeviceProperties(
        "NVIDIA B200", 180 * _GiB, capability=(10, 0), shared_memory_per_block=227 * _KiB,
        multiprocessor_count=148)),
    "rtx5090": ("cuda", DeviceProperties(
        "NVIDIA GeForce RTX 5090", 32 * _GiB, capability=(12, 0),
        shared_memory_per_block=99 * _KiB, multiprocessor_count=170)),
    # ---- AMD Instinct (torch's ROCm build reports them through torch.cuda) ----
    "mi250x": ("rocm", DeviceProperties(
        "AMD Instinct MI250X", 64 * _GiB, capability=(9, 0), arch="gfx90a:sramecc+:xnack-",
        shared_memory_per_block=64 * _KiB, multiprocessor_count=110)),
    "mi300x": ("rocm", DeviceProperties(
        "AMD Instinct MI300X", 192 * _GiB, capability=(9, 4), arch="gfx942:sramecc+:xnack-",
        shared_memory_per_block=64 * _KiB, multiprocessor_count=304)),
    "mi325x": ("rocm", DeviceProperties(
        "AMD Instinct MI325X", 256 * _GiB, capability=(9, 4), arch="gfx942:sramecc+:xnack-",
        shared_memory_per_block=64 * _KiB, multiprocessor_count=304)),
    "mi355x": ("rocm", DeviceProperties(
        "AMD Instinct MI355X", 288 * _GiB, capability=(9, 5), arch="gfx950:sramecc+:xnack-",
        shared_memory_per_block=160 * _KiB, multiprocessor_count=256)),
    # ---- Intel GPUs (torch.xpu) ----
    "max1550": ("xpu", DeviceProperties(
        "Intel(R) Data Center GPU Max 1550", 64 * _GiB, multiprocessor_count=512,
        features=frozenset({"fp16", "fp64", "bf16", "xmx"}))),
    "arc-b580": ("xpu", DeviceProperties(
        "Intel(R) Arc(TM) B580 Graphics", 12 * _GiB, multiprocessor_count=160,
        features=frozenset({"fp16", "bf16", "xmx"}))),
    "arc-a770": ("xpu", DeviceProperties(
        "Intel(R) Arc(TM) A770 Graphics", 16 * _GiB, multiprocessor_count=512,
        features=frozenset({"fp16", "bf16", "xmx"}))),
}


def profile(name: str) -> tuple[str, DeviceProperties]:
    """(kind, properties) of a named profile; the error lists the known ones."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown simulated device {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


def machine_from_spec(spec: str) -> dict[str, SimulatedDeviceInfo]:
    """``"h100:2,rtx4090"`` -> {kind: devices}; ``""``, ``"none"`` or ``"cpu"``: CPU only."""
    machine: dict[str, list[DeviceProperties]] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item or item.lower() in ("none", "cpu"):
            continue
        name, _, count_text = item.partition(":")
        try:
            count = int(count_text) if count_text else 1
        except ValueError:
            raise ValueError(f"simulated device {item!r}: count must be an integer") from None
        if count < 1:
            raise ValueError(f"simulated device {item!r}: count must be at least 1")
        kind, props = profile(name)
        machine.setdefault(kind, []).extend([props] * count)
    return {kind: SimulatedDeviceInfo(devices) for kind, devices in machine.items()}
