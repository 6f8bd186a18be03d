"""Registrations of inference-engine-xpu; targets stay strings until used."""

from __future__ import annotations

from inference_engine import Spec, hookimpl


@hookimpl
def ie_register_platforms() -> list[Spec]:
    return [Spec("xpu", "inference_engine_xpu.platform:XpuPlatform", "Intel GPUs (torch.xpu)")]
