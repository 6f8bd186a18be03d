"""The torch path: sorted dispatch and one grouped GEMM per projection.

``torch.nn.functional.grouped_mm`` takes each expert's row range as a device
tensor of offsets, so nothing is read back to the host (on the CPU it runs one
matmul per expert that got rows, as a loop over ``F.linear`` would, with the
same results). Two cases keep a loop over the experts that reads the
per-expert counts on the host: a shape that breaks grouped_mm's 16-byte stride
rule (tiny test models), and expert biases (gpt-oss), whose ``addmm`` rounding
a grouped GEMM plus a separate bias add would not reproduce bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_engine.layers.moe.activation import SILU, ExpertActivation, expert_activation
from inference_engine.layers.moe.dispatch import ExpertDispatch, sort_by_expert

__all__ = ["fused_moe_torch"]


def fused_moe_torch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: ExpertActivation = SILU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`~inference_engine.layers.moe.reference.fused_moe_reference`.

    Tokens are gathered in expert order, each expert's contiguous rows run its two
    GEMMs, rows are scaled by their routing weight and summed back per token with
    one ``index_add_``.
    """
    t, k = ids.shape
    dispatch = sort_by_expert(ids, gate_up.shape[0])
    xs = x.index_select(0, dispatch.token_of)  # [T*k, K] in expert order
    if (gate_up_bias is None and down_bias is None and _grouped_mm_ok(xs, gate_up)
            and _grouped_mm_ok(xs.new_empty(0, down.shape[2]), down)):
        ys = _grouped(xs, gate_up, down, dispatch, activation)
    else:
        ys = _per_expert_loop(xs, gate_up, down, dispatch, activation, gate_up_bias, down_bias)
    ys.mul_(weights.reshape(-1)[dispatch.order].to(x.dtype).unsqueeze(1))
    out = torch.zeros(t, down.shape[1], dtype=x.dtype, device=x.device)
    return out.index_add_(0, dispatch.token_of, ys)


def _grouped_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``grouped_mm(a, b^T)`` takes these operands: 16-byte aligned row strides, and
    off the CPU only bfloat16 (the dtype its GPU kernels support)."""
    es = a.element_size()
    if not hasattr(F, "grouped_mm") or (a.device.type != "cpu" and a.dtype != torch.bfloat16):
        return False
    return (b.dtype == a.dtype and a.shape[1] * es % 16 == 0 and b.stride(1) * es % 16 == 0
            and b.stride(2) == 1 and b.stride(0) * es % 16 == 0)


def _grouped(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             dispatch: ExpertDispatch, activation: ExpertActivation) -> torch.Tensor:
    """``[T*k, K_out]`` expert outputs of the sorted rows, sync-free."""
    # h: [T*k, 2I]; ys: [T*k, K_out]; offs are the experts' row ends.
    h = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=dispatch.ends)
    act = expert_activation(h, activation, inplace=True)
    if act.stride(0) * act.element_size() % 16:
        act = act.contiguous()
    return F.grouped_mm(act, down.transpose(1, 2), offs=dispatch.ends)


def _per_expert_loop(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     dispatch: ExpertDispatch, activation: ExpertActivation,
                     gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """The same rows, one ``F.linear`` pair per expert; reads the counts on the host."""
    ys = torch.empty(xs.shape[0], down.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for e, n in enumerate(dispatch.counts.tolist()):
        if n == 0:
            continue
        end = start + n
        h = F.linear(xs[start:end], gate_up[e],
                     None if gate_up_bias is None else gate_up_bias[e])
        act = expert_activation(h, activation, inplace=True)
        # Straight into this expert's rows of ys (no temporary + copy).
        torch.matmul(act, down[e].T, out=ys[start:end])
        if down_bias is not None:
            ys[start:end] += down_bias[e]
        start = end
    return ys
