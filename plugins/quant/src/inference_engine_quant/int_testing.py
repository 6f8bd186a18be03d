"""Test helpers: AWQ and GPTQ tensors written with the formulas of their reference code.

Kept in the package (tests cannot import each other under
``--import-mode=importlib``). Nothing here is used at run time.

* GPTQ (the GPTQ paper's ``Quantizer.find_params`` / ``quantize`` and
  AutoGPTQ's ``QuantLinear.pack``): per group ``xmin = min(w, 0)``, ``xmax =
  max(w, 0)``; symmetric: ``xmax = max(|xmin|, xmax)``, ``xmin = -xmax``;
  ``scale = (xmax - xmin) / maxq``; ``zero = round(-xmin / scale)`` or
  ``(maxq + 1) / 2`` when symmetric; ``q = clamp(round(w / scale) + zero, 0, maxq)``.
  Rounding-to-nearest on GPTQ's grid (no Hessian error feedback: the format is
  the same). ``desc_act`` quantizes columns in a permuted order, so group
  ``g_idx[perm[i]] = i // group_size``. ``qweight`` packs along K, ``qzeros``
  along N, v1 storing ``zero - 1`` (masked to ``bits``, as a well-formed
  checkpoint has it).
* AWQ (AutoAWQ ``pseudo_quantize_tensor`` with zero point, ``WQLinear_GEMM``):
  ``scale = max(w_max - w_min, 1e-5) / 15``, ``zero = clamp(-round(w_min / scale), 0, 15)``,
  ``q = clamp(round(w / scale) + zero, 0, 15)``; ``qweight [K, N/8]`` and
  ``qzeros`` packed along N in the order ``[0, 2, 4, 6, 1, 3, 5, 7]``.

Scales are stored in float16 as the tools do; the dequantized weights use the
float16 scales, so they are exactly what a correct loader must reproduce.
"""

from __future__ import annotations

import torch

from inference_engine_quant.int_packing import pack_along

__all__ = ["awq_tensors", "gptq_tensors"]


def gptq_tensors(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                 perm: torch.Tensor | None = None, checkpoint_format: str = "gptq",
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``({".qweight", ".qzeros", ".scales", ".g_idx"}, dequantized [N, K])`` for ``w [N, K]``."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    w = w.float()
    order = torch.arange(k) if perm is None else perm
    size = k if group_size == -1 else group_size
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // size).to(torch.int32)
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        xmin = cols.min(1).values.clamp(max=0)
        xmax = cols.max(1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        both_zero = (xmin == 0) & (xmax == 0)
        xmin = torch.where(both_zero, -1.0, xmin)
        xmax = torch.where(both_zero, 1.0, xmax)
        scale = ((xmax - xmin) / maxq).half().float()
        scales[g] = scale
        zeros[g] = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    s = scales[g_idx.long()].t()  # [N, K]
    z = zeros[g_idx.long()].t()
    q = torch.clamp(torch.round(w / s) + z, 0, maxq)
    deq = (q - z) * s
    stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
    stored_zeros = stored_zeros.to(torch.int32) & maxq
    tensors = {
        ".qweight": pack_along(q.t().to(torch.int32), bits, dim=0),
        ".qzeros": pack_along(stored_zeros, bits, dim=1),
        ".scales": scales.half(),
        ".g_idx": g_idx,
    }
    return tensors, deq


def awq_tensors(w: torch.Tensor, group_size: int = 128,
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``({".qweight", ".qzeros", ".scales"}, dequantized [N, K])`` for ``w [N, K]``."""
    n, k = w.shape
    grouped = w.float().reshape(n, k // group_size, group_size)
    w_max = grouped.amax(dim=2, keepdim=True)
    w_min = grouped.amin(dim=2, keepdim=True)
    scales = ((w_max - w_min).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(w_min / scales)).clamp(0, 15)
    q = torch.clamp(torch.round(grouped / scales) + zeros, 0, 15)
    deq = ((q - zeros) * scales).reshape(n, k)
    tensors = {
        ".qweight": pack_along(q.reshape(n, k).t().to(torch.int32), 4, dim=1, interleaved=True),
        ".qzeros": pack_along(zeros.squeeze(2).t().to(torch.int32), 4, dim=1, interleaved=True),
        ".scales": scales.squeeze(2).t().half().contiguous(),
    }
    return tensors, deq
