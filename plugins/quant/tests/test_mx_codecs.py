"""E2M1, E8M0, MXFP4/MXFP8 and NVFP4 codecs against quant-formats.md's tables and examples.

Expected values are the spec's (hand-computed) numbers or its formulas written
out independently here, never outputs of the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from inference_engine_quant.mx_block import (
    dequantize_mx,
    dequantize_mxfp4,
    quantize_mxfp4,
    quantize_mxfp8,
)
from inference_engine_quant.mx_e2m1 import (
    decode_e2m1,
    decode_packed_e2m1,
    encode_e2m1,
    pack_e2m1,
    unpack_e2m1,
)
from inference_engine_quant.mx_e8m0 import decode_e8m0, e8m0_from_amax
from inference_engine_quant.nvfp4_codec import dequantize_nvfp4, quantize_nvfp4

# The spec's E2M1 code table (section 1): bit 3 sign, bits 2..1 exponent, bit 0 mantissa.
SPEC_E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def e2m1_from_bits(code: int) -> float:
    """The E2M1 value from its bit fields (bias 1), independent of any table."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa  # subnormal: 2^(1-1) * m/2
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def test_all_16_e2m1_codes_decode_as_the_table_and_bit_fields_say():
    codes = torch.arange(16, dtype=torch.uint8)
    decoded = decode_e2m1(codes)
    for code in range(16):
        expected = SPEC_E2M1[code & 7] * (-1 if code & 8 else 1)
        assert decoded[code].item() == expected == e2m1_from_bits(code)
        assert math.copysign(1, decoded[code].item()) == (-1 if code & 8 else 1)
    # Every code encodes back to itself (including -0 -> 8).
    assert torch.equal(encode_e2m1(decoded), codes)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_e2m1_ties_round_to_even(value, expected):
    for sign in (1, -1):
        code = encode_e2m1(torch.tensor([sign * value]))
        assert decode_e2m1(code).item() == sign * expected


def test_e2m1_saturates_and_handles_specials():
    x = torch.tensor([6.0, 6.5, 100.0, float("inf"), -7.0, float("-inf"), -0.0, 0.26, 0.74])
    got = decode_e2m1(encode_e2m1(x))
    assert got.tolist() == [6.0, 6.0, 6.0, 6.0, -6.0, -6.0, -0.0, 0.5, 0.5]
    assert encode_e2m1(torch.tensor([-0.0])).item() == 8


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-8, max_value=8, allow_nan=False, allow_subnormal=False))
def test_e2m1_encode_is_nearest_with_even_ties(v):
    got = decode_e2m1(encode_e2m1(torch.tensor([v], dtype=torch.float32))).item()
    v32 = float(torch.tensor(v, dtype=torch.float32))
    grid = sorted({e2m1_from_bits(c) for c in range(16)})
    clamped = max(-6.0, min(6.0, v32))
    best = min(abs(g - clamped) for g in grid)
    candidates = [g for g in grid if abs(g - clamped) == best]
    if len(candidates) == 2:  # tie: the code with mantissa bit 0
        even = [g for g in candidates if g == 0 or abs(g) in (1.0, 2.0, 4.0)]
        assert got == even[0]
    else:
        assert got == candidates[0]


def test_packing_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[6, 0xC, 1, 0, 1, 8, 5, 2]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    # byte = c[2i] | c[2i+1] << 4
    assert packed.tolist() == [[0xC6, 0x01, 0x81, 0x25]]
    assert torch.equal(unpack_e2m1(packed), codes)
    assert decode_packed_e2m1(packed).tolist() == [[4, -2, 0.5, 0, 0.5, -0.0, 3, 1]]
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_e8m0_floor_rule_edges():
    amax = torch.tensor([20.0, 7.0, 6.0, 1.0, 0.0, float("nan"), 2.0**-140, 2.0**130,
                         float("inf"), 0.75])
    got = e8m0_from_amax(amax, emax_elem=2, max_elem=6.0, rule="floor").tolist()
    # floor(log2 amax) - 2 + 127, clamped to [0, 254]; zero -> 0, NaN -> 255.
    assert got == [129, 127, 127, 125, 0, 255, 0, 254, 254, 124]


def test_e8m0_rceil_rule_never_clips():
    amax = torch.tensor([7.0, 6.0, 20.0, 1000.0])
    fp4 = e8m0_from_amax(amax[:3], 2, 6.0, "rceil")
    assert decode_e8m0(fp4).tolist() == [2.0, 1.0, 4.0]  # 7/6 -> 2, 6/6 -> 1, 20/6 -> 4
    fp8 = e8m0_from_amax(amax[3:], 8, 448.0, "rceil")
    assert decode_e8m0(fp8).tolist() == [4.0]
    with pytest.raises(ValueError, match="rule"):
        e8m0_from_amax(amax, 2, 6.0, "even")


def test_e8m0_decode_edges():
    got = decode_e8m0(torch.tensor([0, 127, 128, 254, 255], dtype=torch.uint8), torch.float64)
    assert got[0].item() == 2.0**-127  # float64: not subject to flush-to-zero
    assert got[1:4].tolist() == [1.0, 2.0, 2.0**127]
    assert math.isnan(got[4].item())
    as_torch = torch.tensor([127, 130], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert decode_e8m0(as_torch).tolist() == [1.0, 8.0]


def test_mxfp4_spec_example():
    block = torch.zeros(32)
    block[:8] = torch.tensor([20, -7, 1.3, 0.6, 2.1, -0.2, 13, 3])
    packed, scales = quantize_mxfp4(block)
    assert scales.tolist() == [129]
    assert packed[:4].tolist() == [0xC6, 0x01, 0x81, 0x25]
    assert packed.shape == (16,)
    deq = dequantize_mx(packed, scales)
    assert deq[:8].tolist() == [16, -8, 2, 0, 2, -0.0, 12, 4]
    assert deq[8:].abs().sum() == 0
    # amax 7: FLOOR gives X = 1 and clips 7 -> 6; RCEIL gives X = 2 and 7 -> 8.
    seven = torch.zeros(32)
    seven[0] = 7
    assert dequantize_mx(*quantize_mxfp4(seven))[0].item() == 6.0
    assert dequantize_mx(*quantize_mxfp4(seven, rule="rceil"))[0].item() == 8.0


def test_mxfp8_spec_example():
    block = torch.zeros(32)
    block[:4] = torch.tensor([1000, -3.3, 0.01, 250])
    values, scales = quantize_mxfp8(block)
    assert scales.tolist() == [128]
    assert values.dtype == torch.float8_e4m3fn
    assert values[:4].float().tolist() == pytest.approx([448, -1.625, 0.005859375, 128])
    deq = dequantize_mx(values, scales)
    assert deq[:4].tolist() == pytest.approx([896, -3.25, 0.01171875, 256])
    rceil = dequantize_mx(*quantize_mxfp8(block, rule="rceil"))
    assert rceil[0].item() == 1024


def test_mx_pads_odd_sizes_and_marks_nan_blocks():
    x = torch.linspace(-3, 3, 45).reshape(1, 45)
    packed, scales = quantize_mxfp4(x)
    assert packed.shape == (1, 32) and scales.shape == (1, 2)
    deq = dequantize_mx(packed, scales)
    assert deq.shape == (1, 64) and deq[0, 45:].abs().sum() == 0
    nan_block = torch.ones(64)
    nan_block[3] = float("nan")
    packed, scales = quantize_mxfp4(nan_block)
    assert scales.tolist() == [255, 125]  # amax 1: floor(log2 1) - 2 + 127
    deq = dequantize_mx(packed, scales)
    assert torch.isnan(deq[:32]).all() and (deq[32:] == 1).all()


def test_mxfp4_matches_a_plain_formula_reference():
    torch.manual_seed(0)
    w = torch.randn(8, 96) * torch.logspace(-3, 2, 8)[:, None]
    packed, scales = quantize_mxfp4(w)
    ref = torch.empty_like(w)
    grid = torch.tensor(sorted({e2m1_from_bits(c) for c in range(16)}))
    for r in range(w.shape[0]):
        for b in range(0, w.shape[1], 32):
            blk = w[r, b:b + 32]
            amax = blk.abs().max().item()
            x = 2.0 ** (math.floor(math.log2(amax)) - 2)
            v = (blk / x).clamp(-6, 6)
            # nearest grid point; exact ties go to the smaller magnitude only when it is even
            idx = (v[:, None] - grid[None, :]).abs().argmin(dim=1)
            q = grid[idx]
            ref[r, b:b + 32] = q * x
    deq = dequantize_mx(packed, scales)
    # argmin picks the first minimum on ties; check ties separately via the RNE test above.
    mismatch = (deq != ref)
    ties = torch.zeros_like(mismatch)
    for r, c in mismatch.nonzero().tolist():
        x = 2.0 ** (math.floor(math.log2(w[r, c // 32 * 32:c // 32 * 32 + 32].abs().max())) - 2)
        v = abs(w[r, c].item() / x)
        ties[r, c] = any(abs(v - m) < 1e-6 for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    assert (mismatch <= ties).all()


def test_dequantize_mxfp4_takes_gpt_oss_block_layout():
    torch.manual_seed(1)
    w = torch.randn(2, 6, 64)  # [E, N, K]
    packed, scales = quantize_mxfp4(w)  # [E, N, 32], [E, N, 2]
    blocks = packed.unflatten(-1, (2, 16))  # gpt-oss: [E, N, K/32, 16]
    dense = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dense, dequantize_mx(packed, scales))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks[:, :, :1], scales)


def test_nvfp4_spec_example():
    w = torch.zeros(2, 16)
    w[0] = torch.linspace(-10, 10, 16)
    w[1, 0] = 100.0  # tensor amax 100
    packed, block_scales, g = quantize_nvfp4(w)
    assert g.item() == pytest.approx(100 / (6 * 448))
    assert block_scales[0, 0].float().item() == 44.0  # e4m3(44.8)
    deq = dequantize_nvfp4(packed, block_scales, g)
    elem_scale = 44 * 100 / (6 * 448)
    assert deq[0, 0].item() == pytest.approx(-6 * elem_scale)  # -10 -> -6.109 -> -6
    assert deq[0, 15].item() == pytest.approx(6 * elem_scale)
    # 8.667 -> 5.295 -> 6; 2.0 would be 1.222 -> 1 (the spec's examples)
    assert deq[0, 14].item() == pytest.approx(6 * elem_scale)
    two = torch.zeros(1, 16)
    two[0, :2] = torch.tensor([10.0, 2.0])
    p2, b2, _ = quantize_nvfp4(torch.cat([two, w[1:]]))
    assert dequantize_nvfp4(p2, b2, torch.tensor(100 / 2688))[0, 1].item() == pytest.approx(
        elem_scale)
    half = torch.zeros(1, 16)
    half[0, 0] = 0.5
    _, b3, _ = quantize_nvfp4(torch.cat([half, w[1:]]))
    assert b3[0, 0].float().item() == 2.25  # 0.5 / 6 / g = 2.24 -> 2.25


def test_nvfp4_zero_block_scale_is_one_and_round_trip_is_close():
    torch.manual_seed(2)
    w = torch.randn(4, 40)
    w[0] = 0
    packed, block_scales, g = quantize_nvfp4(w)
    assert packed.shape == (4, 24) and block_scales.shape == (4, 3)
    assert (block_scales[0].float() == 1).all()
    deq = dequantize_nvfp4(packed, block_scales, g)[:, :40]
    assert deq[0].abs().sum() == 0
    # E2M1 relative step is at most 1/3 of the block scale's range (6 -> 4 gap / 6).
    err = (deq - w).abs().amax(dim=1)
    assert (err[1:] <= w[1:].abs().amax(dim=1) / 6 + 1e-6).all()
