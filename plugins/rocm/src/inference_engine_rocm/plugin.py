"""Registrations of inference-engine-rocm; targets stay strings until used."""

from __future__ import annotations

from typing import Any

from inference_engine import Spec, hookimpl


@hookimpl
def ie_register_platforms() -> list[Spec]:
    return [Spec("rocm", "inference_engine_rocm.platform:RocmPlatform",
                 "AMD ROCm GPUs (torch.version.hip); gfx942/gfx950 tunings")]


@hookimpl
def ie_kernel_tuning_config(op_name: str, platform: Any, shape: dict[str, int]) -> dict | None:
    """Answer from the shipped gfx942/gfx950 tables; None for other archs and ops."""
    arch_name = getattr(platform, "arch_name", None)  # callers may pass no platform
    arch = arch_name() if callable(arch_name) else ""
    if not arch.startswith("gfx"):
        return None
    from inference_engine_rocm.tuning import tuned_config

    return tuned_config(op_name, arch, shape)
