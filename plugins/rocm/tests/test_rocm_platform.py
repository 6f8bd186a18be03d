"""The ROCm platform on simulated MI250X/MI300X/MI325X/MI355X against AMD's published facts."""

from __future__ import annotations

import pytest
import torch
from inference_engine.platforms.device_info import simulate_devices
from inference_engine.platforms.selection import PlatformUnavailableError, select_platform
from inference_engine.platforms.simulated_devices import machine_from_spec
from inference_engine_rocm.platform import RocmPlatform, base_arch

# profile -> (arch, fp8 dtype, fp4)
AMD_FACTS = {
    "mi250x": ("gfx90a", None, False),
    "mi300x": ("gfx942", torch.float8_e4m3fnuz, False),
    "mi325x": ("gfx942", torch.float8_e4m3fnuz, False),
    "mi355x": ("gfx950", torch.float8_e4m3fn, True),
}


@pytest.mark.parametrize("profile", sorted(AMD_FACTS))
def test_rocm_answers(profile):
    arch, fp8, fp4 = AMD_FACTS[profile]
    with simulate_devices(machine_from_spec(profile)):
        platform = select_platform()
        assert isinstance(platform, RocmPlatform)
        assert platform.device_type == "cuda"  # torch's HIP build keeps the cuda device type
        assert platform.arch_name() == arch
        assert platform.capability() is None  # HIP's major/minor are not CUDA capabilities
        assert platform.fp8_dtype() == fp8
        assert platform.supports_fp4() is fp4
        assert torch.bfloat16 in platform.supported_dtypes()
        if fp8 is not None:
            assert platform.fp8_max() == torch.finfo(fp8).max
            assert "torch._scaled_mm (fp8)" in platform.fp8_gemm_kernels()
        else:
            assert platform.fp8_gemm_kernels() == []
        described = platform.describe()
    assert described["gcn_arch_name"].startswith(arch + ":")
    assert described["fp8_dtype"] == {None: None, torch.float8_e4m3fnuz: "e4m3fnuz",
                                      torch.float8_e4m3fn: "e4m3fn"}[fp8]
    assert bool(described["tuning_tables"]) is (arch in ("gfx942", "gfx950"))


def test_gfx942_scale_adjustment_matches_reinterpreting_e4m3fn_bytes():
    """e4m3fn bytes read as e4m3fnuz are worth half; the platform's factor restores them."""
    with simulate_devices(machine_from_spec("mi300x")):
        platform = select_platform()
        factor = platform.fp8_scale_adjustment()
        assert platform.fp8_flavour() == "e4m3fnuz" and platform.fp8_max() == 240.0
    values = torch.linspace(-448, 448, 301).to(torch.float8_e4m3fn)
    bits = values.view(torch.int8)
    bits = torch.where(bits == -128, torch.zeros_like(bits), bits)  # -0 is NaN in fnuz
    as_fnuz = bits.view(torch.float8_e4m3fnuz).float()
    torch.testing.assert_close(as_fnuz * factor, values.float(), rtol=0, atol=0)
    with simulate_devices(machine_from_spec("mi355x")):
        assert select_platform().fp8_scale_adjustment() == 1.0


def test_rocm_selection_and_forcing():
    with simulate_devices(machine_from_spec("mi300x:8")):
        platform = select_platform("rocm", device_ids=[7])
        assert platform.device() == torch.device("cuda", 7)
        assert platform.device_count() == 8
    with simulate_devices(machine_from_spec("h100")):
        with pytest.raises(PlatformUnavailableError, match="no AMD GPU"):
            select_platform("rocm")


@pytest.mark.skipif(torch.version.hip is not None, reason="asserts a torch without ROCm")
def test_real_machine_has_no_rocm():
    # The CPU torch here has torch.version.hip None: ROCm is absent, for a stated reason.
    assert not RocmPlatform.is_present()
    assert "torch.version.hip is None" in RocmPlatform.absence_reason()


def test_base_arch():
    assert base_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert base_arch("gfx950") == "gfx950"
