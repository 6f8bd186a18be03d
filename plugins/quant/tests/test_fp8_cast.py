"""The shared FP8 E4M3 cast against an independent RNE table lookup and the spec's examples."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from inference_engine_quant.fp8_cast import (
    cast_to_fp8,
    dequantize_fp8,
    e4m3fn_to_fnuz,
    fp8_max,
    quantize_fp8,
    scale_from_amax,
)


def _e4m3_value(code: int, bias: int) -> float:
    """Decode a positive E4M3 code (sign bit clear) from the bit fields alone."""
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0:
        return 2.0 ** (1 - bias) * m / 8
    return 2.0 ** (e - bias) * (1 + m / 8)


def _rne_reference(v: float, bias: int, max_code: int) -> float:
    """Nearest positive E4M3 value by exhaustive search, ties to the even code, saturating."""
    if math.isnan(v):
        return math.nan
    sign = -1.0 if v < 0 else 1.0
    a = abs(v)
    values = [_e4m3_value(c, bias) for c in range(max_code + 1)]
    if a >= values[-1]:
        return sign * values[-1]
    best = min(range(len(values)), key=lambda c: (abs(values[c] - a), c % 2))
    return sign * values[best]


def test_formula_table_matches_the_spec_maxima():
    assert _e4m3_value(0x7E, 7) == 448.0 and _e4m3_value(0x01, 7) == 2.0**-9
    assert _e4m3_value(0x7F, 8) == 240.0 and _e4m3_value(0x08, 8) == 2.0**-7


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.0625, 1.0),  # tie between 1.0 (even mantissa) and 1.125 -> 1.0
        (1.1875, 1.25),  # tie between 1.125 and 1.25 (even) -> 1.25
        (260.0, 256.0),  # spec section 3 example
        (-102.0, -104.0),
        (500.0, 448.0),  # saturation
        (1e9, 448.0),
        (float("inf"), 448.0),
        (float("-inf"), -448.0),
        (2.0**-10, 0.0),  # half the smallest subnormal: tie -> 0 (even)
        (1.5 * 2.0**-9, 2.0**-8),  # tie between subnormal codes 1 and 2 -> 2
        (0.0, 0.0),
    ],
)
def test_hand_computed_e4m3fn_cases(value, expected):
    got = cast_to_fp8(torch.tensor([value])).float().item()
    assert got == expected


def test_nan_stays_nan_and_negative_zero_kept_in_fn():
    q = cast_to_fp8(torch.tensor([float("nan"), -0.0]))
    assert math.isnan(q.float()[0].item())
    assert q.view(torch.uint8)[1].item() == 0x80


def test_spec_per_tensor_example_bytes():
    w = torch.tensor([0.02, -0.51, 1.30, -2.24])
    s = scale_from_amax(w.abs().amax(), fp8_max())
    assert s.item() == pytest.approx(0.005)
    q = quantize_fp8(w, s)
    assert q.view(torch.uint8).tolist() == [0x48, 0xED, 0x78, 0xFE]
    assert torch.allclose(dequantize_fp8(q, s), torch.tensor([0.02, -0.52, 1.28, -2.24]))


def test_fnuz_saturates_where_torch_alone_gives_nan():
    x = torch.tensor([300.0, -300.0, 239.0])
    assert torch.isnan(x.to(torch.float8_e4m3fnuz).float()[0])  # why the clamp is needed
    q = cast_to_fp8(x, torch.float8_e4m3fnuz)
    assert q.float().tolist() == [240.0, -240.0, 240.0]
    assert cast_to_fp8(x, torch.float8_e4m3fnuz, fp8_max(torch.float8_e4m3fnuz, dynamic=True)
                       ).float().tolist() == [224.0, -224.0, 224.0]


def test_fn_to_fnuz_keeps_values_and_maps_negative_zero():
    w = torch.tensor([0.02, -0.51, 1.30, -2.24, -0.0])
    s = torch.tensor(0.005)
    q = quantize_fp8(w, s)
    q2, s2 = e4m3fn_to_fnuz(q, s)
    assert q2.dtype == torch.float8_e4m3fnuz and s2.item() == pytest.approx(0.01)
    assert torch.equal(dequantize_fp8(q2, s2), dequantize_fp8(q, s))  # -0 == 0
    assert q2.view(torch.uint8)[-1].item() == 0


def test_zero_amax_gives_unit_scale():
    assert scale_from_amax(torch.tensor([0.0, 4.48]), 448.0).tolist() == pytest.approx([1.0, 0.01])


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-1000.0, max_value=1000.0, allow_nan=False, allow_subnormal=False,
                 width=32))
def test_cast_equals_exhaustive_rne_reference(value):
    assert cast_to_fp8(torch.tensor([value])).float().item() == _rne_reference(value, 7, 0x7E)
    fnuz = cast_to_fp8(torch.tensor([value]), torch.float8_e4m3fnuz).float().item()
    ref = _rne_reference(value, 8, 0x7F)
    assert fnuz == ref or (fnuz == 0.0 and ref == 0.0)
