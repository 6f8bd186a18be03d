"""Plain PyTorch fused MoE: every (token, slot) pair computed on its own.

The ground truth the CPU path and the Triton kernel are checked against.
"""

from __future__ import annotations

import torch

from inference_engine.layers.moe.activation import SILU, ExpertActivation, expert_activation

__all__ = ["fused_moe_reference"]


def fused_moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: ExpertActivation = SILU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token.

    Args:
        x: ``[T, K]``.
        gate_up: ``[E, 2I, K]`` (gate rows then up rows), ``[E, I, K]`` for a non-gated
            ``activation``.
        down: ``[E, K_out, I]``.
        weights, ids: ``[T, k]`` from the router.
        gate_up_bias, down_bias: ``[E, 2I]`` (``[E, I]``), ``[E, K_out]`` or None.

    Returns:
        ``[T, K_out]`` in ``x.dtype``.
    """
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t : t + 1].float() @ gate_up[e].float().T
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].float()
            y = expert_activation(h, activation) @ down[e].float().T
            if down_bias is not None:
                y = y + down_bias[e].float()
            out[t] += weights[t, j].float() * y[0]
    return out.to(x.dtype)
