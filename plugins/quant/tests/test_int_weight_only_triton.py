"""The Triton int4/int8 weight-only GEMM against the torch reference (TRITON_INTERPRET=1, fp32).

The kernel cases run in a child pytest with the variable set (``triton``
reads it at import); here only the wrapper runs. The weights come from the
AWQ and GPTQ writers (formulas of their reference code) converted to the
runtime form by the methods' own conversion, so the kernel sees what a
loaded layer holds: M = 1 and odd M, N and K not multiples of the tile,
4 and 8 bits, act-order ``g_idx``, a bias.
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.testing import run_under_triton_interpreter
from inference_engine_quant.int_packing import pack_along, unpack_along
from inference_engine_quant.int_testing import awq_tensors, gptq_tensors

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
NUM_CASES = 5


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert f"{NUM_CASES} passed, 1 skipped" in stdout, stdout[-2000:]


@pytest.fixture(scope="module")
def kernels():
    if not INTERPRETING:
        pytest.skip("runs in the TRITON_INTERPRET=1 child")
    pytest.importorskip("triton")
    from inference_engine_quant.kernels import int_weight_only_gemm
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(int_weight_only_gemm._int_weight_only_kernel, InterpretedFunction)
    return int_weight_only_gemm


CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "num_warps": 1,
          "num_stages": 1}


def _gptq_runtime(w, bits, group, sym, perm):
    t, deq = gptq_tensors(w, bits, group, sym, perm=perm)
    zeros = (unpack_along(t[".qzeros"], bits, 1) + 1) & ((1 << bits) - 1)
    return t[".qweight"], t[".scales"].float(), zeros.float(), t[".g_idx"], deq


@pytest.mark.parametrize(("m", "n", "k", "bits", "sym", "act_order"), [
    (1, 24, 64, 4, True, False),
    (5, 40, 96, 4, False, True),
    (19, 16, 48, 8, False, False),
    (3, 48, 128, 8, True, True),
])
def test_gptq_weights(kernels, m, n, k, bits, sym, act_order):
    torch.manual_seed(m * 100 + n + k)
    w = torch.randn(n, k)
    perm = torch.randperm(k) if act_order else None
    qweight, scales, zeros, g_idx, deq = _gptq_runtime(w, bits, 16, sym, perm)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    ref = kernels.int_weight_only_reference(x, qweight, scales, zeros, g_idx, bits, bias,
                                            tile_k=16)
    assert torch.allclose(ref, x @ deq.T + bias, atol=1e-4)
    got = kernels.int_weight_only_triton(x, qweight, scales, zeros, g_idx, bits, bias,
                                         config=CONFIG)
    assert got.shape == (m, n)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (got - ref).abs().max()


def test_awq_weights_repacked(kernels):
    torch.manual_seed(7)
    n, k = 40, 256
    t, deq = awq_tensors(torch.randn(n, k), 128)
    qweight = pack_along(unpack_along(t[".qweight"], 4, 1, True), 4, 0)
    zeros = unpack_along(t[".qzeros"], 4, 1, True).float()
    g_idx = (torch.arange(k) // 128).to(torch.int32)
    x = torch.randn(7, k)
    ref = kernels.int_weight_only_reference(x, qweight, t[".scales"].float(), zeros, g_idx, 4)
    assert torch.allclose(ref, x @ deq.T, atol=1e-4)
    got = kernels.int_weight_only_triton(x, qweight, t[".scales"].float(), zeros, g_idx, 4,
                                         config=CONFIG)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (got - ref).abs().max()
