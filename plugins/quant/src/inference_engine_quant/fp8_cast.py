"""The one FP8 E4M3 cast every method uses: clamp to the format maximum, then RNE.

Shared by the FP8 methods (weights, activations) and the MX/NVFP4 methods
(MXFP8 element values, NVFP4 per-16 block scales), so all of them round the
same way (quant-formats.md sections 1-3 and 10):

* ``float8_e4m3fn`` (OCP): max 448. torch's cast already rounds to nearest
  even and saturates, but we clamp first anyway so the rule does not depend on
  the torch version. NaN stays NaN (byte 0x7F/0xFF).
* ``float8_e4m3fnuz`` (AMD MI300, gfx942): max 240, no -0, NaN is only byte
  0x80. torch's cast does *not* saturate (300 -> NaN), so the clamp is
  required. Dynamic (per-call) quantization clamps to 224 instead, as vLLM
  does, to keep headroom (:data:`FNUZ_DYNAMIC_MAX`).

The same byte read as fnuz is exactly half its fn value, so an OCP checkpoint
runs on fnuz hardware by reinterpreting the bytes and doubling the scales
(:func:`e4m3fn_to_fnuz`).

Scales are dequant multipliers everywhere: ``real ~= float(q) * scale``.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3FN_MAX",
    "E4M3FNUZ_MAX",
    "FNUZ_DYNAMIC_MAX",
    "FP8_DTYPES",
    "cast_to_fp8",
    "dequantize_fp8",
    "e4m3fn_to_fnuz",
    "fp8_max",
    "quantize_fp8",
    "scale_from_amax",
]

E4M3FN_MAX = 448.0
E4M3FNUZ_MAX = 240.0
# vLLM's clamp for dynamic activation quantization on fnuz (accuracy headroom).
FNUZ_DYNAMIC_MAX = 224.0

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"unsupported FP8 dtype {dtype}; expected torch.float8_e4m3fn or torch.float8_e4m3fnuz"
        )


def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn, dynamic: bool = False) -> float:
    """Largest magnitude a quantizer maps to: 448 (fn), 240 (fnuz) or 224 (fnuz, dynamic).

    Args:
        dtype: the FP8 E4M3 flavour.
        dynamic: True for scales computed per call (activations); only changes fnuz.
    """
    _check_dtype(dtype)
    if dtype == torch.float8_e4m3fn:
        return E4M3FN_MAX
    return FNUZ_DYNAMIC_MAX if dynamic else E4M3FNUZ_MAX


def cast_to_fp8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, max_value: float | None = None
) -> torch.Tensor:
    """Round ``x`` to FP8 E4M3: clamp to ``±max_value`` (default the format max), then RNE.

    NaN stays NaN (clamp passes it through; the cast maps it to the format's
    NaN). ``±inf`` saturates to ``±max_value``. Input is computed in float32
    (bf16/fp16 values are exact there, so there is no double rounding).
    """
    _check_dtype(dtype)
    limit = fp8_max(dtype) if max_value is None else float(max_value)
    return x.float().clamp(-limit, limit).to(dtype)


def scale_from_amax(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """Dequant scale ``amax / max_value`` in float32; 1.0 where ``amax`` is 0.

    An all-zero row/tile/tensor quantizes to zeros with any scale; 1.0 avoids
    a 0/0 in ``x / scale`` and is what we write to checkpoints for it.
    """
    amax = amax.float()
    return torch.where(amax > 0, amax / max_value, torch.ones_like(amax))


def quantize_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    max_value: float | None = None,
) -> torch.Tensor:
    """``cast_to_fp8(x / scale)`` with ``scale`` broadcast against ``x`` (float32 math)."""
    return cast_to_fp8(x.float() / scale.float(), dtype, max_value)


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``float(q) * scale`` (broadcast), computed in float32, returned as ``out_dtype``."""
    return (q.float() * scale.float()).to(out_dtype)


def e4m3fn_to_fnuz(
    q: torch.Tensor, *scales: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Reinterpret OCP e4m3fn bytes as fnuz and double every scale (vLLM's normalisation).

    Byte 0x80 (-0 in fn) is NaN in fnuz, so it becomes 0x00. Returns
    ``(q_fnuz, *doubled_scales)``; the dequantized values are unchanged.
    """
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"e4m3fn_to_fnuz expects a float8_e4m3fn tensor, got {q.dtype}")
    raw = q.view(torch.uint8).clone()
    raw[raw == 0x80] = 0
    return (raw.view(torch.float8_e4m3fnuz), *(s * 2.0 for s in scales))
