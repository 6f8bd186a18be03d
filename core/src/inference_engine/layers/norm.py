"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.layers.cpu_fused import fused_rms_norm

__all__ = ["RMSNorm", "rms_normalize"]


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
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x [..., hidden]``.

        With ``residual`` the sum ``x + residual`` is normalised and returned
        too, as ``(normed, x + residual)``: the next residual stream.
        """
        fused = fused_rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:  # float32 on CPU: one call instead of five ops
            return fused if residual is not None else fused[0]
        if residual is not None:
            x = x + residual
            return rms_normalize(x, self.eps).mul_(self.weight), x
        return rms_normalize(x, self.eps).mul_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


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
