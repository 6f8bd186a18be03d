"""The XPU platform on simulated Intel GPUs, selection order and device ids."""

from __future__ import annotations

import pytest
import torch
from inference_engine.platforms.device_ids import InvalidDeviceIdsError
from inference_engine.platforms.device_info import simulate_devices
from inference_engine.platforms.selection import PlatformUnavailableError, select_platform
from inference_engine.platforms.simulated_devices import machine_from_spec
from inference_engine_xpu.platform import TorchXpuDeviceInfo, XpuPlatform


@pytest.mark.parametrize("profile,name", [
    ("max1550", "Intel(R) Data Center GPU Max 1550"),
    ("arc-b580", "Intel(R) Arc(TM) B580 Graphics"),
])
def test_xpu_answers(profile, name):
    with simulate_devices(machine_from_spec(profile)):
        platform = select_platform()
        assert isinstance(platform, XpuPlatform)
        assert platform.device() == torch.device("xpu", 0)
        assert platform.arch_name() == name == platform.device_name()
        assert platform.capability() is None
        # No FP8/FP4 matrix math on these parts: quantized weights dequantize.
        assert platform.fp8_dtype() is None and not platform.supports_fp4()
        assert platform.quant_kernels() == ["dequantize + torch matmul"]
        assert platform.supported_dtypes()[0] == torch.bfloat16
        assert "torch_sdpa" in platform.attention_backends()


def test_xpu_priority_below_cuda_and_forcing():
    with simulate_devices(machine_from_spec("h100,arc-b580")):
        assert select_platform().name == "cuda"
        assert select_platform("xpu").name == "xpu"
    with simulate_devices(machine_from_spec("arc-b580")):
        with pytest.raises(PlatformUnavailableError, match="present platforms: xpu, cpu"):
            select_platform("cuda")
    with simulate_devices(machine_from_spec("mi300x")):
        with pytest.raises(PlatformUnavailableError, match="no Intel GPU"):
            select_platform("xpu")


def test_xpu_device_ids():
    with simulate_devices(machine_from_spec("max1550:2")):
        assert select_platform(device_ids=[1]).device() == torch.device("xpu", 1)
        with pytest.raises(InvalidDeviceIdsError, match=r"no device 2; xpu has 2 devices: "
                                                         r"0 \(Intel\(R\) Data Center GPU Max"):
            select_platform(device_ids=[2])


@pytest.mark.skipif(TorchXpuDeviceInfo().device_count() > 0,
                    reason="asserts that this machine has no XPU")
def test_real_machine_has_no_xpu():
    assert TorchXpuDeviceInfo().device_count() == 0
    assert not XpuPlatform.is_present()
    assert "torch.xpu.is_available() is False" in XpuPlatform.absence_reason()


def test_dtypes_follow_reported_features():
    from inference_engine.platforms.device_info import DeviceProperties

    no_bf16 = DeviceProperties("Old iGPU", 4 << 30, features=frozenset({"fp16"}))
    unknown = DeviceProperties("Unknown", 4 << 30)
    with simulate_devices({"xpu": [no_bf16, unknown]}):
        assert select_platform(device_ids=[0]).supported_dtypes() == [torch.float16,
                                                                      torch.float32]
        assert select_platform(device_ids=[1]).supported_dtypes()[0] == torch.bfloat16
