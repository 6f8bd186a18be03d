"""The activations between an expert's two GEMMs.

Gated experts store their weights with the gate rows first and the up rows
second (``gate_up [E, 2I, K]``), so a gated activation reads
``gate = h[:, :I]``, ``up = h[:, I:]``; checkpoints that interleave them
(gpt-oss) are de-interleaved when loaded. Non-gated experts (Nemotron-H's
squared ReLU) have only the up rows (``[E, I, K]``) and apply the activation to
all of ``h``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["GELU_TANH", "RELU2", "SILU", "ExpertActivation", "expert_activation",
           "gated_activation"]

_GATED = ("silu", "swigluoai", "silu_clamped", "gelu_tanh")
_NON_GATED = ("relu2",)


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """Gated: ``silu(gate) * up``; gpt-oss's clamped ``(up + 1) * gate * sigmoid(alpha * gate)``
    ("swigluoai"); DeepSeek-V4's ``silu(min(gate, limit)) * clamp(up, -limit, limit)``
    ("silu_clamped"); Gemma's ``gelu_tanh(gate) * up`` ("gelu_tanh"). Not gated: Nemotron-H's
    ``relu(up)^2`` ("relu2")."""

    name: str = "silu"
    # gpt-oss ("swigluoai"): sigmoid sharpness and the clamp limit (also "silu_clamped"'s).
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.name not in _GATED + _NON_GATED:
            raise ValueError(f"unsupported expert activation {self.name!r}; "
                             f"supported: {', '.join(repr(n) for n in _GATED + _NON_GATED)}")

    @property
    def gated(self) -> bool:
        """Whether the first GEMM produces gate and up halves (``2I`` rows) or up only (``I``)."""
        return self.name in _GATED

    def up_rows(self, intermediate_size: int) -> int:
        """Rows of one expert's first projection."""
        return 2 * intermediate_size if self.gated else intermediate_size


SILU = ExpertActivation("silu")
GELU_TANH = ExpertActivation("gelu_tanh")
RELU2 = ExpertActivation("relu2")


def gated_activation(h: torch.Tensor, act: ExpertActivation,
                     inplace: bool = False) -> torch.Tensor:
    """``h [n, 2I]`` (gate | up) -> ``[n, I]`` for a gated ``act``.

    ``inplace`` lets SiLU reuse ``h``'s gate half (the result is then a strided view of ``h``).
    """
    gate, up = h.chunk(2, dim=-1)
    if act.name == "silu":
        if inplace:
            return F.silu(gate, inplace=True).mul_(up)
        return F.silu(gate) * up
    if act.name == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if act.name not in ("swigluoai", "silu_clamped"):
        raise ValueError(f"expert activation {act.name!r} is not gated")
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    if act.name == "silu_clamped":
        return F.silu(gate) * up
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def expert_activation(h: torch.Tensor, act: ExpertActivation,
                      inplace: bool = False) -> torch.Tensor:
    """The activation of ``act`` on the first GEMM's output: ``[n, 2I]`` -> ``[n, I]`` when
    gated, ``[n, I]`` -> ``[n, I]`` otherwise (``inplace`` may then overwrite ``h``)."""
    if act.gated:
        return gated_activation(h, act, inplace)
    # relu2
    return F.relu(h, inplace=inplace).square_() if inplace else torch.square(F.relu(h))
