"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.layers.cpu_fused import fused_rms_norm
from inference_engine.layers.fused_op_choice import choose_fused_op

__all__ = ["RMSNorm", "rms_norm_cpu", "rms_norm_impl", "rms_norm_torch", "rms_normalize"]

# (x, weight, eps, residual) -> normed, or (normed, x + residual) with a residual.
RMSNormFn = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` over the last dimension, as transformers computes it.

    The statistics are taken in float32 and the normalised value is cast back
    to the input dtype *before* the weight multiplies it (LlamaRMSNorm's
    rounding order), so reduced-precision outputs match transformers bit for
    bit. See :func:`rms_normalize` for the float32 path.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square.
        dtype: parameter dtype (the model's compute dtype).

    The implementation (:func:`rms_norm_cpu`, the Triton kernel or
    :func:`rms_norm_torch`) is chosen here, for the device the weight is made on,
    from the platform's ``fused_op_kernels()``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        # Built under ``torch.device(...)``: the weight's device is where the layer runs.
        self.fused_op = choose_fused_op(self.weight.device)
        self._rms_norm: RMSNormFn = rms_norm_impl(self.fused_op)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x [..., hidden]``.

        With ``residual`` the sum ``x + residual`` is normalised and returned
        too, as ``(normed, x + residual)``: the next residual stream.
        """
        return self._rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, fused_op={self.fused_op}"


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: ``weight * normalise(x [+ residual])``, LlamaRMSNorm's rounding.

    Args:
        x: ``[..., D]``.
        weight: ``[D]``, or anything broadcasting against ``x`` (``[heads, D]`` for
            ``x [T, heads, D]``).
        eps: added to the mean square.
        residual: same shape as ``x``; the sum (in ``x.dtype``) is normalised.

    Returns:
        The normalised ``x``; with ``residual``, ``(normed, x + residual)``.
    """
    if residual is not None:
        x = x + residual
        return rms_normalize(x, eps).mul_(weight), x
    return rms_normalize(x, eps).mul_(weight)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_torch` by the C++ kernel where it applies (float32 CPU), else torch."""
    fused = fused_rms_norm(x, weight, eps, residual)
    if fused is not None:  # float32 on CPU: one call instead of five ops
        return fused if residual is not None else fused[0]
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_impl(fused_op: str) -> RMSNormFn:
    """The RMSNorm function of a :func:`~inference_engine.layers.fused_op_choice.choose_fused_op`
    answer."""
    if fused_op == "triton":
        from inference_engine.layers.triton_fused import rms_norm

        return rms_norm
    return rms_norm_cpu if fused_op == "cpu" else rms_norm_torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps)`` over the last dim, no weight, in ``x.dtype``.

    Float32 uses a vector norm and a few in-place ops on the ``[..., 1]``
    statistics: within 1e-7 relative of ``F.rms_norm`` and several times
    faster than it on CPU for prefill-sized inputs (which decomposes into a
    dozen ops and two copies). Other dtypes go through ``F.rms_norm``, which
    upcasts to float32 and rounds once, exactly as transformers does.

    Callers that weight parts of one tensor differently (q and k heads side
    by side) normalise once and multiply each part in place.
    """
    if x.dtype == torch.float32:
        sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x * sq.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return F.rms_norm(x, (x.shape[-1],), None, eps)
