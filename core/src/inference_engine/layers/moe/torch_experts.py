"""The CPU fast path: sorted dispatch and one matmul pair per expert that got tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_engine.layers.moe.activation import SILU, ExpertActivation, gated_activation
from inference_engine.layers.moe.dispatch import sort_by_expert

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

    Tokens are gathered in expert order, each expert with rows runs its two
    GEMMs on its contiguous slice, rows are scaled by their routing weight
    and summed back per token with one ``index_add_``.
    """
    t, k = ids.shape
    dispatch = sort_by_expert(ids, gate_up.shape[0])
    xs = x.index_select(0, dispatch.token_of)  # [T*k, K] in expert order
    ys = torch.empty(t * k, down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(dispatch.counts):
        if n == 0:
            continue
        end = start + n
        h = F.linear(xs[start:end], gate_up[e],
                     None if gate_up_bias is None else gate_up_bias[e])
        act = gated_activation(h, activation, inplace=True)
        # Straight into this expert's rows of ys (no temporary + copy).
        torch.matmul(act, down[e].T, out=ys[start:end])
        if down_bias is not None:
            ys[start:end] += down_bias[e]
        start = end
    ys.mul_(weights.reshape(-1)[dispatch.order].to(x.dtype).unsqueeze(1))
    out = torch.zeros(t, down.shape[1], dtype=x.dtype, device=x.device)
    return out.index_add_(0, dispatch.token_of, ys)
