"""The quantized Triton kernels compiled on a CUDA GPU, in bf16, against their torch references.

Marked ``gpu`` and skipped without CUDA (their float32 twins run under
``TRITON_INTERPRET=1`` on the CPU: test_fp8_triton, test_mx_triton,
test_quant_moe_triton, test_mx_dot_scaled). Run by bench/gpu_check.sh's
``kernels`` step. Tolerances are bf16's (outputs rounded once; relative
Frobenius error).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = "cuda"


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("m", [1, 3, 17, 129])
def test_fp8_block_gemm_split_k_and_tiled(m):
    from inference_engine_quant.fp8_math import (
        quantize_activation,
        quantize_weight_blockwise,
        reference_fp8_linear,
    )
    from inference_engine_quant.kernels.fp8_block_gemm import fp8_block_gemm

    torch.manual_seed(m)
    n, k = 1000, 1400  # not multiples of 128
    w = torch.randn(n, k, device=CUDA) * 0.05
    x = torch.randn(m, k, device=CUDA)
    q, s = quantize_weight_blockwise(w)
    q_x, s_x = quantize_activation(x, 128)
    got = fp8_block_gemm(q_x, s_x, q.t(), s.t().contiguous(), 128, 128, torch.bfloat16)
    ref = reference_fp8_linear(x, q.t(), s.t(), (128, 128), 128)
    assert _rel(got, ref) < 1e-2


@pytest.mark.parametrize("m", [1, 17, 129])
@pytest.mark.parametrize("kind", ["e8m0", "e4m3"])
def test_fp4_gemm_bf16(m, kind):
    from inference_engine_quant.kernels.fp4_gemm import fp4_linear_reference, fp4_linear_triton
    from inference_engine_quant.mx_block import quantize_mxfp4
    from inference_engine_quant.nvfp4_codec import quantize_nvfp4

    torch.manual_seed(m)
    n, k = 1000, 1408
    w = torch.randn(n, k, device=CUDA)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    if kind == "e8m0":
        packed, scales = quantize_mxfp4(w)
        g = None
    else:
        packed, scales, g0 = quantize_nvfp4(w)
        g = torch.full((n,), float(g0), device=CUDA)
    got = fp4_linear_triton(x, packed, scales, kind, k, global_scale=g)
    ref = fp4_linear_reference(x.float(), packed, scales, kind, k, global_scale=g)
    assert _rel(got, ref) < 1e-2


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("t", [1, 64, 257])
def test_quantized_fused_moe_bf16(fmt, t):
    from inference_engine_quant.fp8_math import quantize_weight_blockwise
    from inference_engine_quant.mx_block import quantize_mxfp4
    from inference_engine_quant.quant_moe import (
        QuantExperts,
        fused_moe_quant_reference,
        fused_moe_quant_triton,
    )

    torch.manual_seed(t)
    e, topk, hidden, inter = 16, 4, 1000, 360
    gate_up = torch.randn(e, 2 * inter, hidden, device=CUDA) * 0.05
    down = torch.randn(e, hidden, inter, device=CUDA) * 0.05
    if fmt == "fp8":
        parts = []
        for w in (gate_up, down):
            qs, ss = zip(*(quantize_weight_blockwise(we) for we in w), strict=True)
            parts += [torch.stack(qs), torch.stack(ss)]
        experts = QuantExperts("fp8", *parts, hidden, inter, (128, 128))
    else:
        parts = [*quantize_mxfp4(gate_up), *quantize_mxfp4(down)]
        experts = QuantExperts("mxfp4", *parts, hidden, inter, (1, 32))
    x = torch.randn(t, hidden, device=CUDA, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=CUDA)[:topk] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, topk, device=CUDA), -1)
    ref = fused_moe_quant_reference(x.float(), experts, weights, ids)
    got = fused_moe_quant_triton(x, experts, weights, ids)
    assert _rel(got, ref) < 2e-2


def test_dot_scaled_where_the_platform_lists_it():
    from inference_engine.interfaces.platform import KERNEL_TRITON_MXFP4
    from inference_engine.platforms.selection import current_platform
    from inference_engine_quant.kernels.mx_dot_scaled_gemm import mxfp4_dot_scaled_linear
    from inference_engine_quant.mx_block import dequantize_mx, quantize_mxfp4, quantize_mxfp8

    if KERNEL_TRITON_MXFP4 not in current_platform().fp4_gemm_kernels():
        pytest.skip("this GPU lists no native MXFP4 GEMM (sm100+ only)")
    torch.manual_seed(0)
    n, k, m = 1000, 1408, 33
    w, x = torch.randn(n, k, device=CUDA), torch.randn(m, k, device=CUDA)
    packed, scales = quantize_mxfp4(w)
    xq, xs = quantize_mxfp8(x)
    ref = dequantize_mx(xq, xs)[:, :k] @ dequantize_mx(packed, scales)[:, :k].T
    got = mxfp4_dot_scaled_linear(x.to(torch.bfloat16), packed, scales, k)
    assert _rel(got, ref) < 1e-2
