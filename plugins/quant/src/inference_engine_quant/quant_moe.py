"""Fused MoE on quantized experts: the torch path (and ground truth) and the Triton launch.

:class:`QuantExperts` describes one layer's packed experts (FP8 with block or
per-row scales, or MXFP4). :func:`fused_moe_quant` runs a step through them
with the implementation the layer chose at build (``layer.kernel`` from the
platform's ``moe_kernels()``):

* ``"triton"``: two launches of the grouped GEMM of
  :mod:`inference_engine_quant.kernels.quant_moe_gemm` (tiles decoded in
  registers), block alignment on the device, no host sync;
* ``"torch"`` (CPU): :func:`fused_moe_quant_reference`, which dequantizes only
  the experts that received tokens this step, one at a time (on the host,
  reading the routing back is free), never the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from inference_engine.layers.moe.activation import SILU, ExpertActivation, gated_activation

from inference_engine_quant.mx_block import dequantize_mx

__all__ = ["QuantExperts", "dequantize_expert", "fused_moe_quant", "fused_moe_quant_reference",
           "moe_launch_config"]


@dataclass(frozen=True)
class QuantExperts:
    """One MoE layer's quantized experts (gate rows then up rows in ``gate_up``).

    ``fmt == "fp8"``: ``gate_up [E, 2I, H]`` / ``down [E, H, I]`` float8 with float32
    multipliers ``[E, ceil(rows/gn), ceil(cols/gk)]`` per ``block = (gn, gk)``.
    ``fmt == "mxfp4"``: uint8 ``[E, rows, ceil(cols/32)*16]`` and E8M0 bytes
    ``[E, rows, ceil(cols/32)]``; ``block`` is ``(1, 32)``.
    """

    fmt: str
    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    hidden_size: int
    intermediate_size: int
    block: tuple[int, int] = (1, 32)
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt not in ("fp8", "mxfp4"):
            raise ValueError(f"unknown quantized expert format {self.fmt!r}; "
                             f"expected 'fp8' or 'mxfp4'")


def _expand(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """One multiplier per element from a block grid (a block wider than the matrix: one)."""
    bn, bk = min(block[0], rows), min(block[1], cols)
    return scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def dequantize_expert(experts: QuantExperts, part: str, e: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[rows, cols]`` of one expert's ``"gate_up"`` or ``"down"`` weight."""
    q = getattr(experts, part)[e]
    s = getattr(experts, f"{part}_scale")[e]
    cols = experts.hidden_size if part == "gate_up" else experts.intermediate_size
    if experts.fmt == "mxfp4":
        return dequantize_mx(q, s, torch.float32)[:, :cols].to(dtype)
    rows = q.shape[0]
    return (q.float() * _expand(s.float(), experts.block, rows, cols)).to(dtype)


def fused_moe_quant_reference(x: torch.Tensor, experts: QuantExperts, weights: torch.Tensor,
                              ids: torch.Tensor, activation: ExpertActivation = SILU
                              ) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``, each routed expert dequantized once.

    Computes in ``x.dtype`` (float32 accumulation of the weighted sum), as the dense
    torch path does; returns ``[T, hidden]`` in ``x.dtype``.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    present, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
    out = torch.zeros(t, experts.down.shape[1], dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1)
    start = 0
    for e, count in zip(present.tolist(), counts.tolist(), strict=True):
        rows = order[start:start + count]
        start += count
        tokens = rows // k
        h = x[tokens] @ dequantize_expert(experts, "gate_up", e, x.dtype).T
        if experts.gate_up_bias is not None:
            h = h + experts.gate_up_bias[e].to(h.dtype)
        y = gated_activation(h, activation) @ dequantize_expert(experts, "down", e, x.dtype).T
        if experts.down_bias is not None:
            y = y + experts.down_bias[e].to(y.dtype)
        out.index_add_(0, tokens, y.float() * flat_weights[rows].float()[:, None])
    return out.to(x.dtype)


def _default_config(shape: dict[str, int]) -> dict[str, Any]:
    """Decode sizes (few rows per expert): narrow N tiles so many programs stream the
    weights; larger batches: square tiles."""
    if shape["M"] * shape["topk"] <= shape["E"] * 4:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 3}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8,
            "num_warps": 8, "num_stages": 3}


def moe_launch_config(fmt: str, shape: dict[str, int]) -> dict[str, Any]:
    """The ``ie_kernel_tuning_config`` answer for op ``fused_moe_<fmt>`` (M bucketed to a power
    of two, so tables hold buckets, not every M), over this kernel's default."""
    from inference_engine.kernel_tuning import tuning_config

    bucketed = {**shape, "M": 1 << max(0, (max(shape["M"], 1) - 1).bit_length())}
    return tuning_config(f"fused_moe_{fmt}", bucketed, _default_config(bucketed))


def fused_moe_quant_triton(x: torch.Tensor, experts: QuantExperts, weights: torch.Tensor,
                           ids: torch.Tensor, activation: ExpertActivation = SILU,
                           config: dict[str, Any] | None = None) -> torch.Tensor:
    """Same contract as :func:`fused_moe_quant_reference`: the core's two grouped-GEMM
    launches (:func:`~inference_engine.layers.moe.triton_moe.grouped_moe`), each over the
    quantized experts."""
    from inference_engine.layers.moe.triton_moe import grouped_moe

    from inference_engine_quant.kernels.quant_moe_gemm import quant_grouped_gemm

    t, k = ids.shape
    num_experts, up_rows = experts.gate_up.shape[0], experts.gate_up.shape[1]
    hidden, inter = experts.hidden_size, experts.intermediate_size
    out_dim = experts.down.shape[1]
    shape = {"M": t, "N": up_rows, "K": hidden, "E": num_experts, "topk": k}
    operands = {"gate_up": (experts.gate_up, experts.gate_up_scale, up_rows, hidden,
                            experts.gate_up_bias),
                "down": (experts.down, experts.down_scale, out_dim, inter, experts.down_bias)}

    def gemm(which: str, a: torch.Tensor, c: torch.Tensor, routing: torch.Tensor | None,
             sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor,
             rows_per_a: int, cfg: dict[str, Any]) -> None:
        w, scale, n, k_dim, bias = operands[which]
        quant_grouped_gemm(a, w, scale, experts.fmt, experts.block, n, k_dim, c, bias, routing,
                           sorted_ids, block_expert, num_padded, rows_per_a, cfg)

    return grouped_moe(x, ids, weights, num_experts, up_rows, out_dim, activation, gemm,
                       config or moe_launch_config(experts.fmt, shape),
                       config or moe_launch_config(experts.fmt,
                                                   {**shape, "N": out_dim, "K": inter}))


def fused_moe_quant(kernel: str, x: torch.Tensor, experts: QuantExperts, weights: torch.Tensor,
                    ids: torch.Tensor, activation: ExpertActivation = SILU) -> torch.Tensor:
    """Run the step through ``kernel`` (``"triton"`` or ``"torch"``, the layer's build-time
    choice)."""
    if kernel == "triton":
        return fused_moe_quant_triton(x, experts, weights, ids, activation)
    return fused_moe_quant_reference(x, experts, weights, ids, activation)
