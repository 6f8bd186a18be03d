"""E8M0 shared scales of the OCP Microscaling formats (a power of two per 32 elements).

An E8M0 byte ``b`` means ``2^(b - 127)``; 0xFF is NaN and there is no zero
(quant-formats.md sections 1 and 6). torch's cast to ``float8_e8m0fnu``
rounds the mantissa half-up, which is *not* the OCP rule, so exponents are
computed here with integer ops (``torch.frexp``) and kept as uint8, the way
checkpoints store them.

Two rules choose the exponent of a block with largest magnitude ``amax``:

* ``"floor"`` (OCP v1.0, torchao FLOOR, the default):
  ``floor(log2(amax)) - emax_elem``; values in ``[max_elem*X, 2^(emax+1)*X)``
  then saturate (up to ~25% clipping for FP4).
* ``"rceil"`` (NVIDIA hardware / Transformer Engine):
  ``ceil(log2(amax / max_elem))``; never clips.

Either way the exponent is clamped to ``[-127, 127]``; an all-zero block gets
byte 0 and a block holding NaN byte 0xFF. ``amax = inf`` clamps to 127.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "ScaleRule",
    "decode_e8m0",
    "e8m0_from_amax",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF

ScaleRule = Literal["floor", "rceil"]


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` for positive finite float32 ``x``, exactly (subnormals included)."""
    _, exponent = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return exponent.long() - 1


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` for positive finite float32 ``x``, exactly."""
    mantissa, exponent = torch.frexp(x)
    return exponent.long() - (mantissa == 0.5).long()


def e8m0_from_amax(
    amax: torch.Tensor, emax_elem: int, max_elem: float, rule: ScaleRule = "floor"
) -> torch.Tensor:
    """E8M0 scale bytes (uint8) for blocks with largest magnitudes ``amax``.

    Args:
        amax: per-block ``max(|v|)`` (any float dtype; NaN where a block holds NaN).
        emax_elem: exponent of the element type's largest normal (2 for E2M1, 8 for E4M3).
        max_elem: the element type's largest finite value (6 for E2M1, 448 for E4M3).
        rule: ``"floor"`` (OCP) or ``"rceil"``.

    Raises:
        ValueError: for an unknown rule.
    """
    amax = amax.float()
    is_nan = torch.isnan(amax)
    is_zero = amax == 0
    # Placeholders keep frexp away from 0, NaN and inf; those are patched below.
    safe = torch.where(is_nan | is_zero | torch.isinf(amax), torch.ones_like(amax), amax)
    if rule == "floor":
        exponent = _floor_log2(safe) - emax_elem
    elif rule == "rceil":
        exponent = _ceil_log2(safe / max_elem)
    else:
        raise ValueError(f"unknown MX scale rule {rule!r}; expected 'floor' or 'rceil'")
    exponent = torch.where(torch.isinf(amax), torch.full_like(exponent, 127), exponent)
    exponent = exponent.clamp(-127, 127)
    byte = exponent + E8M0_BIAS
    byte = torch.where(is_zero, torch.zeros_like(byte), byte)
    byte = torch.where(is_nan, torch.full_like(byte, E8M0_NAN), byte)
    return byte.to(torch.uint8)


def decode_e8m0(scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``2^(b - 127)`` for uint8 (or ``float8_e8m0fnu``) bytes; 0xFF decodes to NaN.

    Byte 0 is ``2^-127``, a float32 (and bfloat16) subnormal: exact unless the
    process flushes denormals, where it reads as 0 (only all-zero blocks get it).
    """
    if scale_bytes.dtype == torch.float8_e8m0fnu:
        scale_bytes = scale_bytes.view(torch.uint8)
    if scale_bytes.dtype != torch.uint8:
        raise ValueError(f"E8M0 scales must be uint8 bytes, got {scale_bytes.dtype}")
    exponent = scale_bytes.to(torch.int32) - E8M0_BIAS
    # float64 on request: 2^-127 is normal there, while float32 flushes it to 0 when
    # the process flushes denormals (torch.set_flush_denormal).
    work = torch.float64 if dtype == torch.float64 else torch.float32
    value = torch.ldexp(torch.ones(exponent.shape, dtype=work, device=exponent.device), exponent)
    value = torch.where(scale_bytes == E8M0_NAN, torch.full_like(value, float("nan")), value)
    return value.to(dtype)
