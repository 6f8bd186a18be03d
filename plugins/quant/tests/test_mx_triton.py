"""The Triton FP4 dequant-GEMM against the tiled torch reference (TRITON_INTERPRET=1, fp32).

``triton`` reads TRITON_INTERPRET when it is imported and when it decorates
kernels, so the kernel cases run in a child pytest started with the
variable set (triton may already be imported in this process); here only
the wrapper runs. Shapes are tiny: M = 1 (decode), odd M, N and K that are
not multiples of the tile, MXFP4 (E8M0 per 32) and NVFP4 (E4M3 per 16 with
per-row float32 globals).
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.testing import run_under_triton_interpreter
from inference_engine_quant.mx_block import dequantize_mx, quantize_mxfp4
from inference_engine_quant.nvfp4_codec import dequantize_nvfp4, quantize_nvfp4

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
NUM_CASES = 10


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert f"{NUM_CASES} passed, 1 skipped" in stdout, stdout[-2000:]


@pytest.fixture(scope="module")
def kernels():
    """The kernel module, its kernel decorated in interpreter mode (child process only)."""
    if not INTERPRETING:
        pytest.skip("runs in the TRITON_INTERPRET=1 child")
    pytest.importorskip("triton")
    from inference_engine_quant.kernels import fp4_gemm
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(fp4_gemm._fp4_gemm_kernel, InterpretedFunction)
    return fp4_gemm


CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "num_warps": 1,
          "num_stages": 1}


@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 64), (5, 40, 96), (19, 16, 40)])
def test_mxfp4_triton_matches_reference(kernels, m, n, k):
    torch.manual_seed(m * 100 + n + k)
    w = torch.randn(n, k)
    packed, scales = quantize_mxfp4(w)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    ref = kernels.fp4_linear_reference(x, packed, scales, "e8m0", k, bias=bias, tile_rows=7)
    # The reference itself is dequantize-then-matmul.
    dense = dequantize_mx(packed, scales)[:, :k]
    assert torch.allclose(ref, x @ dense.T + bias, atol=1e-5)
    got = kernels.fp4_linear_triton(x, packed, scales, "e8m0", k, bias=bias, config=CONFIG)
    assert got.shape == (m, n)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 32, 48), (17, 20, 64)])
def test_nvfp4_triton_matches_reference(kernels, m, n, k):
    torch.manual_seed(m + n + k)
    w = torch.randn(n, k) * 3
    packed, block_scales, g = quantize_nvfp4(w)
    # Per-row global scales, as a fused q/k/v layer holds them.
    rows_g = torch.full((n,), float(g))
    rows_g[: n // 2] *= 0.5
    x = torch.randn(m, k)
    ref = kernels.fp4_linear_reference(x, packed, block_scales, "e4m3", k, global_scale=rows_g)
    dense = dequantize_nvfp4(packed, block_scales, rows_g)[:, :k]
    assert torch.allclose(ref, x @ dense.T, atol=1e-5)
    got = kernels.fp4_linear_triton(x, packed, block_scales, "e4m3", k, global_scale=rows_g,
                                    config=CONFIG)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (got - ref).abs().max()


def test_e4m3_subnormal_scales_decode_in_kernel(kernels):
    """Block scales 0x01..0x07 (subnormal E4M3) and large ones decode like torch's cast."""
    n, k = 16, 32
    packed = torch.full((n, k // 2), 0x22, dtype=torch.uint8)  # every element 1.0
    raw = torch.arange(1, n * (k // 16) + 1, dtype=torch.uint8).reshape(n, k // 16) * 3
    scales = raw.view(torch.float8_e4m3fn)
    x = torch.ones(1, k)
    ref = kernels.fp4_linear_reference(x, packed, scales, "e4m3", k)
    got = kernels.fp4_linear_triton(x, packed, scales, "e4m3", k, config=CONFIG)
    assert torch.allclose(got, ref, rtol=1e-6)


@pytest.mark.parametrize(("m", "split", "scale_kind"),
                         [(1, 2, "e8m0"), (3, 3, "e4m3"), (17, 2, "e8m0"), (129, 4, "e4m3")])
def test_split_k_matches_reference(kernels, m, split, scale_kind):
    """The small-M launch (K split over programs, float32 partials summed), K and N off the
    tiles, with bias (MXFP4) and per-row globals (NVFP4)."""
    torch.manual_seed(m + split)
    n, k = 24, 160
    w = torch.randn(n, k)
    x = torch.randn(m, k)
    if scale_kind == "e8m0":
        packed, scales = quantize_mxfp4(w)
        g, bias = None, torch.randn(n)
    else:
        packed, scales, g0 = quantize_nvfp4(w)
        g, bias = torch.full((n,), float(g0)), None
    ref = kernels.fp4_linear_reference(x, packed, scales, scale_kind, k, global_scale=g,
                                       bias=bias)
    got = kernels.fp4_linear_triton(x, packed, scales, scale_kind, k, global_scale=g, bias=bias,
                                    config={**CONFIG, "SPLIT_K": split})
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (got - ref).abs().max()
