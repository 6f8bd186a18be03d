"""FP8 kernel choice per platform (simulated GPUs), the _scaled_mm path, and fnuz conversion.

GPUs are simulated by objects answering the Platform questions a quant method
may ask (``device_type``, ``fp8_dtype()``, ``arch_name()``, ``supports_triton()``),
with FP8 math from capability 8.9 as quant-formats.md section 9 says.
The ``_scaled_mm`` path runs here on CPU tensors: torch's CPU ``_scaled_mm``
accepts the same row-wise scales as the CUDA one (quant-formats.md section 2).
"""

from __future__ import annotations

import pytest
import torch
from inference_engine.builtin.platforms.cpu import CpuPlatform
from inference_engine_quant.fp8 import Fp8Method
from inference_engine_quant.fp8_linear import (
    KERNEL_NAMES,
    apply_fp8_linear,
    choose_fp8_kernel,
    finalize_fp8_layer,
)
from inference_engine_quant.fp8_math import (
    dequantize_weight_kn,
    quantize_weight_blockwise,
    quantize_weight_per_channel,
    reference_fp8_linear,
)
from inference_engine_quant.kernels.fp8_block_gemm import HAS_TRITON
from inference_engine_quant.ptpc_fp8 import PtpcFp8Method


class SimulatedCuda:
    """An NVIDIA GPU of one compute capability."""

    device_type = "cuda"

    def __init__(self, capability: tuple[int, int], triton: bool = True) -> None:
        self.capability = capability
        self.triton = triton

    def arch_name(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def fp8_dtype(self) -> torch.dtype | None:
        return torch.float8_e4m3fn if self.capability >= (8, 9) else None

    def supports_triton(self) -> bool:
        return self.triton


def cuda_with(capability: tuple[int, int], triton: bool = True) -> SimulatedCuda:
    return SimulatedCuda(capability, triton)


class Gfx:
    """A ROCm device as a platform describes it (ROCm torch uses device type 'cuda')."""

    device_type = "cuda"

    def __init__(self, arch: str) -> None:
        self.arch = arch

    def arch_name(self) -> str:
        return self.arch

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.arch.startswith("gfx94") else torch.float8_e4m3fn

    def supports_triton(self) -> bool:
        return True


def test_cpu_always_uses_the_reference():
    assert choose_fp8_kernel(CpuPlatform(), blockwise=False) == "reference"
    assert choose_fp8_kernel(CpuPlatform(), blockwise=True) == "reference"
    assert choose_fp8_kernel(CpuPlatform(), True, True) == "reference_dequantized"
    assert Fp8Method.kernel_for(CpuPlatform()) == KERNEL_NAMES["reference"]
    assert PtpcFp8Method.kernel_for(CpuPlatform()) == KERNEL_NAMES["reference"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize(
    ("capability", "per_tensor", "block"),
    [
        ((7, 5), "triton_weight_only", "triton_weight_only"),
        ((8, 0), "triton_weight_only", "triton_weight_only"),
        ((8, 6), "triton_weight_only", "triton_weight_only"),
        ((8, 9), "scaled_mm", "triton"),
        ((9, 0), "scaled_mm", "triton"),
        ((10, 0), "scaled_mm", "triton"),
        ((12, 0), "scaled_mm", "triton"),
    ],
)
def test_nvidia_choice_by_capability(capability, per_tensor, block):
    platform = cuda_with(capability)
    assert choose_fp8_kernel(platform, blockwise=False) == per_tensor
    assert choose_fp8_kernel(platform, blockwise=True) == block
    described = Fp8Method.kernel_for(platform)
    assert KERNEL_NAMES[per_tensor] in described and KERNEL_NAMES[block] in described


def test_without_triton_support():
    assert choose_fp8_kernel(cuda_with((8, 0), triton=False), True) == "reference"
    assert choose_fp8_kernel(cuda_with((9, 0), triton=False), False) == "scaled_mm"
    assert choose_fp8_kernel(cuda_with((9, 0), triton=False), True) == "reference"


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_rocm_choice():
    for arch in ("gfx942", "gfx950"):
        assert choose_fp8_kernel(Gfx(arch), blockwise=False) == "scaled_mm"
        assert choose_fp8_kernel(Gfx(arch), blockwise=True) == "triton"


def _per_channel_layer(platform, w, input_scale=None):
    q, s = quantize_weight_per_channel(w)
    layer = torch.nn.Module()
    finalize_fp8_layer(layer, q.t(), s.reshape(1, -1), (w.shape[1], 1), input_scale, True,
                       platform, torch.float32)
    return layer, q, s


@pytest.mark.skipif(not HAS_TRITON, reason="the choice needs triton present")
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_path_equals_reference(static):
    torch.manual_seed(0)
    w = torch.randn(24, 40) * 0.1
    x = torch.randn(5, 40)
    input_scale = torch.tensor(x.abs().max().item() / 448) if static else None
    layer, q, s = _per_channel_layer(cuda_with((9, 0)), w, input_scale)
    assert layer.fp8_kernel == "scaled_mm"
    assert layer.weight.shape == (40, 24) and layer.weight.stride() == (1, 40)  # column-major (K,N)
    ref = reference_fp8_linear(x, q.t(), s.reshape(1, -1), (40, 1), None, input_scale=input_scale)
    assert torch.allclose(apply_fp8_linear(layer, x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="the choice needs triton present")
def test_fnuz_platform_converts_and_keeps_values():
    """gfx942: OCP bytes become fnuz with doubled scales; dequantized weights are unchanged."""
    torch.manual_seed(1)
    w = torch.randn(24, 40) * 0.1
    layer, q, s = _per_channel_layer(Gfx("gfx942"), w)
    assert layer.weight.dtype == torch.float8_e4m3fnuz
    assert torch.equal(layer.weight_scale, 2 * s.reshape(1, -1))
    assert torch.equal(dequantize_weight_kn(layer.weight, layer.weight_scale, (40, 1)),
                       dequantize_weight_kn(q.t(), s.reshape(1, -1), (40, 1)))
    x = torch.randn(3, 40)
    # Activations quantize to fnuz with the dynamic clamp of 224 (reference uses the weight dtype).
    ref = reference_fp8_linear(x, layer.weight, layer.weight_scale, (40, 1), None)
    assert torch.allclose(apply_fp8_linear(layer, x), ref, atol=1e-5, rtol=1e-5)
    gfx950, _, _ = _per_channel_layer(Gfx("gfx950"), w)
    assert gfx950.weight.dtype == torch.float8_e4m3fn


def test_ptpc_on_fnuz_quantizes_with_224():
    method = PtpcFp8Method(platform=Gfx("gfx942"))
    layer = torch.nn.Module()
    method.create_weights(layer, "l", 16, [8], torch.float32)
    w = torch.randn(8, 16)
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fnuz
    assert layer.weight.float().abs().amax().item() == 224.0
    assert torch.allclose(layer.weight_scale.flatten(), w.abs().amax(dim=1) / 224)


def test_tiled_reference_equals_untiled(monkeypatch):
    import inference_engine_quant.fp8_linear as fl

    torch.manual_seed(2)
    w = torch.randn(96, 320) * 0.1
    q, s = quantize_weight_blockwise(w, (32, 64))
    layer = torch.nn.Module()
    finalize_fp8_layer(layer, q.t(), s.t(), (64, 32), None, True, CpuPlatform(), torch.float32)
    x = torch.randn(4, 320)
    whole = apply_fp8_linear(layer, x)
    monkeypatch.setattr(fl, "_REFERENCE_TILE_ELEMENTS", 96 * 64)
    assert torch.allclose(apply_fp8_linear(layer, x), whole, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize(("capability", "per_tensor", "block"), [
    ((8, 0), "triton_weight_only", "triton_weight_only"),
    ((9, 0), "scaled_mm", "triton"),
])
def test_real_cuda_platform_on_a_simulated_machine(capability, per_tensor, block):
    """The core's CudaPlatform answering from simulated device facts drives the same choice."""
    device_info = pytest.importorskip("inference_engine.platforms.device_info")
    from inference_engine.builtin.platforms.cuda import CudaPlatform

    gpu = device_info.DeviceProperties(name="sim", total_memory=80 << 30, capability=capability,
                                       shared_memory_per_block=228 << 10)
    with device_info.simulate_devices({"cuda": [gpu]}):
        platform = CudaPlatform()
        if not getattr(platform, "supports_triton", lambda: True)():
            pytest.skip("this triton build has no NVIDIA backend to report")
        assert choose_fp8_kernel(platform, blockwise=False) == per_tensor
        assert choose_fp8_kernel(platform, blockwise=True) == block


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize(("arch", "dtype"), [
    ("gfx942:sramecc+:xnack-", torch.float8_e4m3fnuz),
    ("gfx950", torch.float8_e4m3fn),
])
def test_real_rocm_platform_on_a_simulated_machine(arch, dtype):
    """The ROCm plugin's platform: fnuz on gfx942 (weights converted), OCP on gfx950."""
    device_info = pytest.importorskip("inference_engine.platforms.device_info")
    rocm = pytest.importorskip("inference_engine_rocm.platform")
    gpu = device_info.DeviceProperties(name="sim", total_memory=192 << 30, arch=arch,
                                       shared_memory_per_block=64 << 10)
    with device_info.simulate_devices({"rocm": [gpu]}):
        platform = rocm.RocmPlatform()
        assert platform.fp8_dtype() == dtype
        torch.manual_seed(5)
        layer, q, s = _per_channel_layer(platform, torch.randn(16, 32) * 0.1)
    assert layer.weight.dtype == dtype
    assert layer.fp8_kernel in ("scaled_mm", "reference")
    expected = 2 * s.reshape(1, -1) if dtype == torch.float8_e4m3fnuz else s.reshape(1, -1)
    assert torch.equal(layer.weight_scale, expected)
