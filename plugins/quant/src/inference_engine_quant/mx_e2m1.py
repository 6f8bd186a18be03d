"""FP4 E2M1 elements: encode with round-to-nearest-even and saturation, decode, pack two per byte.

E2M1 is 1 sign, 2 exponent (bias 1) and 1 mantissa bit (quant-formats.md section 1):
codes 0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and ``code | 8`` is the negative.
There is no NaN or Inf; values beyond 6 saturate. torch's ``float4_e2m1fn_x2``
is storage only (no casts), so encoding and decoding are done here.

Packing follows torchao, compressed-tensors, ModelOpt and gpt-oss: element
``2i`` in the low nibble, ``2i+1`` in the high one, ``byte = c[2i] | c[2i+1] << 4``.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "decode_e2m1",
    "decode_packed_e2m1",
    "encode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
]

E2M1_MAX = 6.0

# Value of each 4-bit code; index = code.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Midpoints between neighbouring magnitudes and, per midpoint, whether a tie rounds up
# (to the code with mantissa bit 0, i.e. the even one): 0.25->0, 0.75->1, 1.25->1,
# 1.75->2, 2.5->2, 3.5->4, 5->4.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)

# byte -> (low value, high value): one gather decodes a packed tensor.
_PAIR_LUT = torch.stack(
    [E2M1_VALUES[torch.arange(256) & 0xF], E2M1_VALUES[torch.arange(256) >> 4]], dim=-1
)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) of ``x``: RNE to the E2M1 grid, saturating at ±6.

    ±inf saturates to ±6. NaN has no E2M1 encoding; it becomes a (signed) zero
    code, which is why MX scales mark a NaN block with the NaN scale 0xFF.
    The sign bit follows ``torch.signbit``, so ``-0.05`` encodes as ``-0`` (code 8).
    """
    x = x.float()
    mag = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in zip(_MIDPOINTS, _TIE_ROUNDS_UP, strict=True):
        up = mag >= midpoint if tie_up else mag > midpoint
        codes += up.to(torch.uint8)
    codes |= torch.signbit(x).to(torch.uint8) << 3
    return codes


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit codes (any integer dtype, values 0..15)."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` uint8, element ``2i`` in the low nibble.

    Raises:
        ValueError: when the last dimension is odd (pad to a block first).
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` uint8 -> ``[..., K]`` codes (low nibble first)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def decode_packed_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., K/2]`` packed uint8 -> ``[..., K]`` values in ``dtype`` (one table gather)."""
    lut = _PAIR_LUT.to(device=packed.device, dtype=dtype)
    return lut[packed.long()].flatten(-2)
