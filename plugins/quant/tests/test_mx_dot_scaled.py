"""The native MX paths (``tl.dot_scaled``, MXFP8 activations; MXFP4 and MXFP8 weights) vs
dequantize-then-matmul.

Runs in a ``TRITON_INTERPRET=1`` child (the interpreter emulates ``dot_scaled`` in
float32); the reference dequantizes the MXFP8-quantized activations and the MXFP4
weights with the codecs of ``mx_block`` and multiplies in float32. The 16-bit-activation
form is not checked here (the interpreter's bf16 is unreliable). Also: the MXFP4 and MXFP8
linear formats pick this kernel only where the platform lists it.
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.builtin.platforms.cpu import CpuPlatform
from inference_engine.interfaces.platform import KERNEL_TRITON_MXFP4
from inference_engine.testing import run_under_triton_interpreter
from inference_engine_quant.mx_block import dequantize_mx, quantize_mxfp4, quantize_mxfp8

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")
CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, num_warps=1, num_stages=1)


class _Blackwell(CpuPlatform):
    """A platform that lists the native MXFP4 GEMM (as CUDA sm100 does)."""

    def supports_triton(self) -> bool:
        return True

    def fp4_gemm_kernels(self) -> list[str]:
        return [KERNEL_TRITON_MXFP4]


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "4 passed" in stdout, stdout[-2000:]


def _reference(x, packed, scales, k, bias):
    xq, xs = quantize_mxfp8(x)
    dense = dequantize_mx(packed, scales)[:, :k]
    y = dequantize_mx(xq, xs)[:, :k] @ dense.T
    return y + bias if bias is not None else y


@interp
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (17, 24, 160)])
def test_dot_scaled_equals_reference(m, n, k):
    from inference_engine_quant.kernels.mx_dot_scaled_gemm import mxfp4_dot_scaled_linear

    torch.manual_seed(m + n)
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    packed, scales = quantize_mxfp4(w)
    got = mxfp4_dot_scaled_linear(x, packed, scales, k, bias=bias, config=CONFIG)
    torch.testing.assert_close(got, _reference(x, packed, scales, k, bias), atol=1e-4,
                               rtol=1e-5)


@interp
def test_mxfp4_format_chooses_dot_scaled_where_listed():
    from inference_engine_quant.mx_linear import fp4_kernel_name
    from inference_engine_quant.mxfp4 import Mxfp4Format

    assert "dot_scaled" in fp4_kernel_name(_Blackwell(), "MXFP4")
    assert "dot_scaled" not in fp4_kernel_name(CpuPlatform(), "MXFP4")
    torch.manual_seed(5)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(24, 64), requires_grad=False)
    layer.mx_input_size, layer.mx_params_dtype = 64, torch.float32
    fmt = Mxfp4Format(True, False, "floor", _Blackwell())
    fmt.process_weights_after_loading(layer)
    assert layer.mx_kernel == "dot_scaled"
    x = torch.randn(3, 64)
    packed, scales = layer.weight_blocks.flatten(-2), layer.weight_scales
    torch.testing.assert_close(fmt.apply(layer, x, None), _reference(x, packed, scales, 64, None),
                               atol=1e-4, rtol=1e-5)


@interp
def test_mxfp8_weights_through_dot_scaled_where_listed():
    """MXFP8 weights held (K, N) as the engine keeps them, given as their [N, K] view."""
    from inference_engine_quant.mxfp8 import Mxfp8Format

    torch.manual_seed(6)
    n, k = 40, 96
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
    layer.mx_input_size, layer.mx_params_dtype = k, torch.float32
    fmt = Mxfp8Format(True, False, "floor", _Blackwell())
    fmt.process_weights_after_loading(layer)
    assert layer.mx_kernel == "dot_scaled"
    x, bias = torch.randn(5, k), torch.randn(n)
    xq, xs = quantize_mxfp8(x)
    dense = dequantize_mx(layer.weight.t(), layer.weight_scale.t())[:, :k]
    ref = dequantize_mx(xq, xs)[:, :k] @ dense.T + bias
    torch.testing.assert_close(fmt.apply(layer, x, bias), ref, atol=1e-4, rtol=1e-5)
