"""Platforms answer from their device facts; selection, forcing and --device-ids.

Expected answers are written from the vendors' published facts (capability
tables, FP8/FP4 support per generation), not from the code under test.
"""

from __future__ import annotations

import logging

import pytest
import torch
from inference_engine.config import ParallelConfig
from inference_engine.platforms.device_ids import InvalidDeviceIdsError, parse_device_ids
from inference_engine.platforms.device_info import (
    DeviceProperties,
    SimulatedDeviceInfo,
    TorchCudaDeviceInfo,
    simulate_devices,
)
from inference_engine.platforms.selection import PlatformUnavailableError, select_platform
from inference_engine.platforms.simulated_devices import PROFILES, machine_from_spec
from inference_engine.registry import UnknownNameError
from inference_engine.testing import has_accelerator


def _machine(spec: str):
    return simulate_devices(machine_from_spec(spec))


# profile -> (arch, family, fp8, fp4, bf16 native)
NVIDIA_FACTS = {
    "t4": ("sm75", "sm75", None, False, False),
    "a100": ("sm80", "sm80", None, False, True),
    "a10": ("sm86", "sm80", None, False, True),
    "l4": ("sm89", "sm89", torch.float8_e4m3fn, False, True),
    "rtx4090": ("sm89", "sm89", torch.float8_e4m3fn, False, True),
    "h100": ("sm90", "sm90", torch.float8_e4m3fn, False, True),
    "b200": ("sm100", "sm100", torch.float8_e4m3fn, True, True),
    "rtx5090": ("sm120", "sm120", torch.float8_e4m3fn, True, True),
}


@pytest.mark.parametrize("profile", sorted(NVIDIA_FACTS))
def test_cuda_capability_answers(profile):
    arch, family, fp8, fp4, bf16 = NVIDIA_FACTS[profile]
    with _machine(profile):
        platform = select_platform()
        assert platform.name == "cuda"
        assert platform.device_type == "cuda"
        assert platform.arch_name() == arch
        assert platform.cuda_family() == family
        assert platform.fp8_dtype() == fp8
        assert platform.supports_fp4() is fp4
        assert (torch.bfloat16 in platform.supported_dtypes()) is bf16
        assert platform.fp8_scale_adjustment() == 1.0
        if fp8 is None:
            assert platform.fp8_gemm_kernels() == [] and platform.fp8_max() is None
        else:
            assert platform.fp8_flavour() == "e4m3fn"
            assert platform.fp8_max() == 448.0
            assert platform.fp8_gemm_kernels()[0] == "torch._scaled_mm (fp8)"
        assert bool(platform.fp4_gemm_kernels()) is fp4
        assert platform.quant_kernels()[-1] == "dequantize + torch matmul"
        assert platform.device(0) == torch.device("cuda", 0)


def test_sm120_has_the_small_shared_memory_of_consumer_parts():
    with _machine("rtx5090"):
        small = select_platform().properties().shared_memory_per_block
    with _machine("b200"):
        large = select_platform().properties().shared_memory_per_block
    assert small < 100 * 1024 < 200 * 1024 < large


def test_cpu_only_machine_picks_cpu_and_reports_truthfully():
    with simulate_devices({}):
        platform = select_platform()
    assert platform.name == "cpu"
    assert platform.fp8_dtype() is None and not platform.supports_fp4()
    assert platform.device() == torch.device("cpu")
    free, total = platform.memory_info()
    assert 0 < free <= total
    assert not platform.info.simulated  # the CPU is always the real host


@pytest.mark.skipif(has_accelerator(), reason="asserts that this machine is CPU-only")
def test_real_machine_here_is_cpu():
    # This test machine has a CPU-only torch: no CUDA/ROCm devices are reported.
    assert TorchCudaDeviceInfo(hip=False).device_count() == 0
    assert TorchCudaDeviceInfo(hip=True).device_count() == 0
    assert select_platform().name == "cpu"


def test_selection_priority_and_forcing():
    with _machine("h100"):
        assert select_platform().name == "cuda"
        assert select_platform("cpu").name == "cpu"  # forcing a lower-priority platform
    with simulate_devices({}):
        with pytest.raises(PlatformUnavailableError,
                           match="no cuda device is usable here .*; present platforms: cpu"):
            select_platform("cuda")


def test_unknown_platform_names_registered_ones():
    with pytest.raises(UnknownNameError, match="registered: .*cpu"):
        select_platform("tpu")


def test_injected_device_source_without_profiles():
    custom = DeviceProperties("Test GPU", 8 << 30, capability=(8, 9), free_memory=3 << 30)
    with simulate_devices({"cuda": SimulatedDeviceInfo([custom])}):
        platform = select_platform()
        assert platform.device_name() == "Test GPU"
        assert platform.memory_info() == (3 << 30, 8 << 30)
        described = platform.describe()
    assert described["simulated"] is True
    assert described["fp8_dtype"] == "e4m3fn"
    assert described["devices"] == [{"index": 0, "name": "Test GPU", "total_memory_bytes": 8 << 30}]


# ---- --device-ids ------------------------------------------------------------


def test_parse_device_ids():
    assert parse_device_ids("0,2") == [0, 2]
    assert parse_device_ids(" 3 ") == [3]
    assert parse_device_ids([1, 0]) == [1, 0]
    assert parse_device_ids(None) is None and parse_device_ids("") is None
    with pytest.raises(InvalidDeviceIdsError, match="non-negative, got -1"):
        parse_device_ids("0,-1")
    with pytest.raises(InvalidDeviceIdsError, match="device 1 more than once"):
        parse_device_ids("1,0,1")
    with pytest.raises(InvalidDeviceIdsError, match="'gpu1' is not a device index"):
        parse_device_ids("gpu1")
    with pytest.raises(InvalidDeviceIdsError, match="not a device index"):
        parse_device_ids([True])


def test_device_ids_select_devices_and_out_of_range_names_them():
    with _machine("h100:2,a100"):  # one platform, mixed GPUs are listed in order
        platform = select_platform(device_ids=[2])
        assert platform.device() == torch.device("cuda", 2)
        assert platform.device_name() == "NVIDIA A100-SXM4-80GB"
        assert platform.arch_name() == "sm80"  # facts of the selected device
        with pytest.raises(InvalidDeviceIdsError) as err:
            select_platform(device_ids=[1, 3])
    message = str(err.value)
    assert "no device 3" in message
    assert ("cuda has 3 devices: 0 (NVIDIA H100 80GB HBM3), 1 (NVIDIA H100 80GB HBM3), "
            "2 (NVIDIA A100-SXM4-80GB)") in message


def test_cpu_has_only_device_zero():
    with pytest.raises(InvalidDeviceIdsError, match=r"cpu has 1 device: 0 \("):
        select_platform("cpu", device_ids=[1])


def test_visible_devices_notice(monkeypatch, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with _machine("h100:2"), caplog.at_level(logging.WARNING):
        select_platform(device_ids=[1])
        with pytest.raises(InvalidDeviceIdsError, match="relative to the devices "
                                                         "CUDA_VISIBLE_DEVICES=5,7 leaves"):
            select_platform(device_ids=[5])
    notices = [r.getMessage() for r in caplog.records if "CUDA_VISIBLE_DEVICES" in r.getMessage()]
    assert notices == ["CUDA_VISIBLE_DEVICES=5,7 is set: device ids (--device-ids) index the "
                       "devices it leaves visible, not physical device numbers"]


def test_engine_config_device_ids():
    assert ParallelConfig(device_ids="1").device_ids == [1]
    with pytest.raises(ValueError, match="more than once"):
        ParallelConfig(device_ids=[0, 0])
    with pytest.raises(ValueError, match="names 2 devices, but one rank drives one device"):
        ParallelConfig(device_ids="0,2")
    # One device per rank: two ranks of tensor parallelism take two ids.
    assert ParallelConfig(device_ids="0,2", tensor_parallel_size=2).device_ids == [0, 2]
    # Data parallelism: one device per DP engine too (the mp / Ray front end starts them).
    assert ParallelConfig(device_ids="0,1", data_parallel_size=2).device_ids == [0, 1]
    with pytest.raises(ValueError, match="with --tensor-parallel-size > 1 on the ray executor"):
        ParallelConfig(data_parallel_size=2, tensor_parallel_size=2,
                       distributed_executor_backend="ray")


def test_profiles_are_consistent():
    for name, (kind, props) in PROFILES.items():
        assert kind in ("cuda", "rocm", "xpu"), name
        assert props.total_memory > 0, name
        assert (props.capability is not None) == (kind != "xpu"), name
        assert bool(props.arch) == (kind == "rocm"), name
    with pytest.raises(ValueError, match="unknown simulated device 'h900'; known: .*h100"):
        machine_from_spec("h900")
