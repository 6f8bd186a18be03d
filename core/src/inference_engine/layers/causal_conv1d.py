"""The causal depthwise conv's one-token update (Mamba-2 decode), torch reference and choice.

A decoding sequence's conv window is its last ``kernel - 1`` inputs, kept in its state
slot (``conv_state [num_slots, dim, kernel - 1]``). One step appends the new input,
takes the per-channel dot product with the ``[dim, kernel]`` weights (plus bias) and
keeps the last ``kernel - 1`` inputs. :mod:`.triton_causal_conv1d` does the same in one
launch for every decoding sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["causal_conv1d_update_torch", "choose_conv_update"]


def causal_conv1d_update_torch(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                               weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One new input per sequence through the causal depthwise conv.

    Args:
        x: ``[n, dim]`` the new inputs.
        conv_state: ``[num_slots, dim, kernel - 1]``, updated in place at ``slots``.
        slots: ``[n]`` int64.
        weight: ``[dim, kernel]``; bias: ``[dim]`` or None.

    Returns:
        ``[n, dim]`` in ``weight``'s dtype (no activation).
    """
    window = torch.cat([conv_state.index_select(0, slots),
                        x.to(conv_state.dtype).unsqueeze(-1)], dim=-1)  # [n, dim, kernel]
    conv_state.index_copy_(0, slots, window[:, :, 1:])
    out = (window.to(weight.dtype) * weight).sum(-1)
    return out + bias if bias is not None else out


# (x, conv_state, slots, weight, bias) -> [n, dim], as causal_conv1d_update_torch.
ConvUpdate = Callable[..., torch.Tensor]


def choose_conv_update(fused_op: str) -> ConvUpdate:
    """The conv update for a :func:`~inference_engine.layers.fused_op_choice.choose_fused_op`
    answer: the Triton kernel where the platform runs Triton, else the torch reference."""
    if fused_op == "triton":
        from inference_engine.layers.triton_causal_conv1d import causal_conv1d_update_triton

        return causal_conv1d_update_triton
    return causal_conv1d_update_torch
