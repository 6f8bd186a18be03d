"""The gated activations between an expert's two GEMMs.

Expert weights are stored with the gate rows first and the up rows second
(``gate_up [E, 2I, K]``), so every activation reads ``gate = h[:, :I]``,
``up = h[:, I:]``; checkpoints that interleave them (gpt-oss) are
de-interleaved when loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ExpertActivation", "SILU", "gated_activation"]


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """``silu(gate) * up``, gpt-oss's clamped ``(up + 1) * gate * sigmoid(alpha * gate)``
    ("swigluoai"), or DeepSeek-V4's ``silu(min(gate, limit)) * clamp(up, -limit, limit)``
    ("silu_clamped")."""

    name: str = "silu"
    # gpt-oss ("swigluoai"): sigmoid sharpness and the clamp limit (also "silu_clamped"'s).
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.name not in ("silu", "swigluoai", "silu_clamped"):
            raise ValueError(f"unsupported expert activation {self.name!r}; "
                             f"supported: 'silu', 'swigluoai', 'silu_clamped'")


SILU = ExpertActivation("silu")


def gated_activation(h: torch.Tensor, act: ExpertActivation,
                     inplace: bool = False) -> torch.Tensor:
    """``h [n, 2I]`` (gate | up) -> ``[n, I]``.

    ``inplace`` lets SiLU reuse ``h``'s gate half (the result is then a strided view of ``h``).
    """
    gate, up = h.chunk(2, dim=-1)
    if act.name == "silu":
        if inplace:
            return F.silu(gate, inplace=True).mul_(up)
        return F.silu(gate) * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    if act.name == "silu_clamped":
        return F.silu(gate) * up
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))
