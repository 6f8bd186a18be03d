"""The Triton FP8 GEMM against the plain-PyTorch reference, under ``TRITON_INTERPRET=1``.

``triton.jit`` decides at import whether it interprets, so the kernel cases
run in a child pytest with the variable set; in this process only the
wrapper test runs. Shapes are tiny, with odd M (not a multiple of the tile),
M = 1 (decode), N and K not multiples of the block, per-channel, 128x128
block and weight-only schemes, on FP8 inputs and on their float32 upcast.
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.testing import run_under_triton_interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=2, num_warps=1,
              num_stages=1)


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "16 passed, 1 skipped" in stdout, stdout[-2000:]  # only the wrapper skips


interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


@interp
@pytest.mark.parametrize(
    ("m", "k", "n", "block_k", "block_n"),
    [
        (1, 64, 48, 64, 1),  # decode, per channel (one K block)
        (5, 96, 80, 32, 32),  # odd M, block scales
        (17, 100, 40, 32, 16),  # M over one tile, K and N not multiples of the block
        (33, 256, 160, 128, 128),  # the real 128x128 blocks with partial N tile
    ],
)
@pytest.mark.parametrize("upcast", [False, True])
def test_block_gemm_equals_reference(m, k, n, block_k, block_n, upcast):
    from inference_engine_quant.fp8_math import (
        quantize_activation,
        quantize_weight_blockwise,
        reference_fp8_linear,
    )
    from inference_engine_quant.kernels.fp8_block_gemm import fp8_block_gemm

    torch.manual_seed(m * 7 + k)
    w = torch.randn(n, k) * 0.2
    x = torch.randn(m, k)
    q, s = quantize_weight_blockwise(w, (block_n, block_k))
    q_kn, s_kn = q.t(), s.t().contiguous()
    group = None if block_k >= k else block_k
    q_x, s_x = quantize_activation(x, group)
    a, b = (q_x.float(), q_kn.float()) if upcast else (q_x, q_kn)
    bias = torch.randn(n)
    got = fp8_block_gemm(a, s_x, b, s_kn, block_k, block_n, torch.float32, bias=bias,
                         config=CONFIG)
    ref = reference_fp8_linear(x, q_kn, s_kn, (block_k, block_n), group, bias=bias)
    assert got.shape == (m, n)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (got - ref).abs().max()


@interp
@pytest.mark.parametrize("m", [1, 7])
def test_weight_only_equals_reference(m):
    from inference_engine_quant.fp8_math import quantize_weight_blockwise, reference_fp8_linear
    from inference_engine_quant.kernels.fp8_block_gemm import fp8_block_gemm

    torch.manual_seed(m)
    w = torch.randn(72, 96) * 0.2
    x = torch.randn(m, 96)
    q, s = quantize_weight_blockwise(w, (32, 32))
    got = fp8_block_gemm(x, None, q.t().float(), s.t().contiguous(), 32, 32, torch.float32,
                         config=CONFIG)
    ref = reference_fp8_linear(x, q.t(), s.t(), (32, 32), None, act_quant=False)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5)


@interp
def test_layer_on_simulated_fp8_gpu_uses_triton_and_matches_reference():
    """The method's whole path (kernel choice, activation quant, launch) with a simulated sm90."""
    from inference_engine_quant.fp8_linear import apply_fp8_linear, finalize_fp8_layer
    from inference_engine_quant.fp8_math import quantize_weight_blockwise, reference_fp8_linear

    class Sm90:
        name = "cuda"
        device_type = "cuda"

        def kernel_tuning_default(self, op_name, shape):
            return None

        def fp8_dtype(self):
            return torch.float8_e4m3fn

        def arch_name(self):
            return "sm90"

        def supports_triton(self):
            return True

    torch.manual_seed(3)
    w = torch.randn(160, 256) * 0.1
    q, s = quantize_weight_blockwise(w)
    layer = torch.nn.Module()
    finalize_fp8_layer(layer, q.t(), s.t(), (128, 128), None, True, Sm90(), torch.float32)
    assert layer.fp8_kernel == "triton"
    x = torch.randn(3, 256)
    ref = reference_fp8_linear(x, q.t(), s.t(), (128, 128), 128)
    assert torch.allclose(apply_fp8_linear(layer, x), ref, atol=1e-4, rtol=1e-5)


@interp
@pytest.mark.parametrize(("m", "split"), [(1, 2), (3, 3), (17, 4), (129, 2)])
def test_split_k_equals_reference(m, split):
    """The small-M launch (K split over programs, partials summed) on odd shapes: N and K not
    multiples of the tiles, 32x32 blocks, bias."""
    from inference_engine_quant.fp8_math import (
        quantize_activation,
        quantize_weight_blockwise,
        reference_fp8_linear,
    )
    from inference_engine_quant.kernels.fp8_block_gemm import fp8_block_gemm

    torch.manual_seed(m)
    k, n = 200, 72
    w = torch.randn(n, k) * 0.2
    x = torch.randn(m, k)
    q, s = quantize_weight_blockwise(w, (32, 32))
    q_x, s_x = quantize_activation(x, 32)
    bias = torch.randn(n)
    got = fp8_block_gemm(q_x.float(), s_x, q.t().float(), s.t().contiguous(), 32, 32,
                         torch.float32, bias=bias, config={**CONFIG, "SPLIT_K": split})
    ref = reference_fp8_linear(x, q.t(), s.t(), (32, 32), 32, bias=bias)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (got - ref).abs().max()


def test_auto_split_k_covers_the_gpu_only_for_small_m():
    from inference_engine_quant.kernels.fp8_block_gemm import auto_split_k

    assert auto_split_k(1, 4096, 4096, 16, 64, 128) == 4  # 64 tiles -> 256 programs
    assert auto_split_k(4096, 4096, 4096, 64, 128, 128) == 1  # 2048 tiles: enough
    assert auto_split_k(1, 4096, 256, 16, 64, 128) == 1  # two K blocks: nothing to split
