"""Quantized fused MoE (FP8 block / per-row, MXFP4) against the dense plain reference.

Ground truth is the core's :func:`fused_moe_reference` (every token and slot on
its own) on weights dequantized by the format codecs (``fp8_math``,
``mx_block``); both the torch path that the CPU runs and the Triton grouped
GEMM (in a ``TRITON_INTERPRET=1`` child, float32) must equal it. Shapes are odd:
T in 1, 3, 17, hidden and intermediate not multiples of the tiles.
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.layers.moe.activation import SILU, ExpertActivation
from inference_engine.layers.moe.reference import fused_moe_reference
from inference_engine.testing import run_under_triton_interpreter
from inference_engine_quant.fp8_math import quantize_weight_blockwise, quantize_weight_per_channel
from inference_engine_quant.mx_block import dequantize_mx, quantize_mxfp4
from inference_engine_quant.quant_moe import QuantExperts, fused_moe_quant_reference

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")

E, HIDDEN, INTER = 5, 72, 40  # neither a multiple of the 32/64-wide tiles
CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=2, num_warps=1,
              num_stages=1)


def _fp8_part(w: torch.Tensor, block: tuple[int, int] | None):
    """``(q, scale grid, dense)`` of ``w [E, rows, cols]``; block None: per row."""
    qs, ss, dense = [], [], []
    for we in w:
        if block is None:
            q, s = quantize_weight_per_channel(we)
            d = q.float() * s
        else:
            q, s = quantize_weight_blockwise(we, block)
            full = (s.repeat_interleave(block[0], 0)[: we.shape[0]]
                    .repeat_interleave(block[1], 1)[:, : we.shape[1]])
            d = q.float() * full
        qs.append(q)
        ss.append(s)
        dense.append(d)
    return torch.stack(qs), torch.stack(ss).float(), torch.stack(dense)


def make_experts(fmt: str, bias: bool, seed: int = 0):
    """Quantized experts and their dequantized dense twin ``(gate_up, down)``."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=g) * 0.2
    down = torch.randn(E, HIDDEN, INTER, generator=g) * 0.2
    biases = (torch.randn(E, 2 * INTER, generator=g), torch.randn(E, HIDDEN, generator=g)) \
        if bias else (None, None)
    if fmt == "mxfp4":
        parts = []
        for w in (gate_up, down):
            q, s = quantize_mxfp4(w)
            parts += [q, s, dequantize_mx(q, s, torch.float32)[..., : w.shape[-1]]]
        block = (1, 32)
    else:
        block = (32, 32) if fmt == "fp8_block" else None
        parts = [*_fp8_part(gate_up, block), *_fp8_part(down, block)]
        if block is None:
            block = (1, 1 << 30)
    experts = QuantExperts("mxfp4" if fmt == "mxfp4" else "fp8", parts[0], parts[1], parts[3],
                           parts[4], HIDDEN, INTER, block, *biases)
    return experts, parts[2], parts[5], biases


def _routing(t: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    return weights, ids


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "7 passed" in stdout, stdout[-2000:]


@pytest.mark.skipif(INTERPRETING, reason="runs in the parent")
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_row", "mxfp4"])
def test_torch_path_equals_reference(fmt):
    experts, gu, dn, (gb, db) = make_experts(fmt, bias=fmt == "mxfp4")
    weights, ids = _routing(17, 2, 1)
    x = torch.randn(17, HIDDEN)
    act = ExpertActivation("swigluoai") if fmt == "mxfp4" else SILU
    ref = fused_moe_reference(x, gu, dn, weights, ids, act, gb, db)
    got = fused_moe_quant_reference(x, experts, weights, ids, act)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@interp
@pytest.mark.parametrize(("fmt", "t", "k"), [
    ("fp8_block", 1, 2), ("fp8_block", 17, 2), ("fp8_row", 3, 3), ("mxfp4", 1, 2),
    ("mxfp4", 17, 3), ("mxfp4", 129, 1),
])
def test_triton_grouped_gemm_equals_reference(fmt, t, k):
    from inference_engine_quant.quant_moe import fused_moe_quant_triton

    bias = fmt == "mxfp4"
    experts, gu, dn, (gb, db) = make_experts(fmt, bias)
    weights, ids = _routing(t, k, t)
    x = torch.randn(t, HIDDEN)
    ref = fused_moe_reference(x, gu, dn, weights, ids, SILU, gb, db)
    got = fused_moe_quant_triton(x, experts, weights, ids, SILU, config=CONFIG)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@interp
def test_fp8_real_128_blocks_with_partial_tiles():
    """DeepSeek's 128x128 blocks with hidden/intermediate not multiples of 128."""
    from inference_engine_quant.quant_moe import fused_moe_quant_triton

    g = torch.Generator().manual_seed(9)
    hidden, inter = 200, 136
    gate_up = torch.randn(3, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(3, hidden, inter, generator=g) * 0.1
    q1, s1, d1 = _fp8_part(gate_up, (128, 128))
    q2, s2, d2 = _fp8_part(down, (128, 128))
    experts = QuantExperts("fp8", q1, s1, q2, s2, hidden, inter, (128, 128))
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [1.0, 0.0]])
    ids = torch.tensor([[0, 2], [2, 1], [1, 0]])
    x = torch.randn(3, hidden, generator=g)
    ref = fused_moe_reference(x, d1, d2, weights, ids)
    got = fused_moe_quant_triton(x, experts, weights, ids,
                                 config={**CONFIG, "BLOCK_SIZE_K": 64})
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
