"""Expert selection: scores, optional group-limited choice, top-k, renormalisation.

One :class:`RouterSpec` covers the routers of the supported MoE families:

- Qwen3-MoE / Mixtral / MiniMax-M1: softmax over all experts, top-k, optional
  renormalisation of the chosen k.
- GraniteMoE: top-k of the logits, softmax over those k (the same numbers as
  softmax + top-k + renormalise, computed the way transformers does).
- DeepSeek-V2: softmax, top-k (optionally group-limited by each group's best
  expert), times ``routed_scaling_factor``.
- DeepSeek-V3 / GLM-4-MoE / MiniMax-M2: sigmoid scores; the *choice* uses
  ``scores + e_score_correction_bias`` (groups ranked by the sum of their top-2),
  the *weights* are the uncorrected scores of the chosen experts, renormalised
  and scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["RouterSpec", "route"]

Scoring = Literal["softmax", "sigmoid", "topk_softmax"]


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How one MoE layer turns router logits into (weights, expert ids)."""

    num_experts: int
    top_k: int
    # "softmax" / "sigmoid" over all experts, or "topk_softmax" (softmax over the top-k logits).
    scoring: Scoring = "softmax"
    # Divide the chosen weights by their sum.
    renormalize: bool = False
    # Group-limited routing: experts split into num_groups groups, keep the best topk_groups.
    num_groups: int = 1
    topk_groups: int = 1
    # How a group is ranked: "max" (DeepSeek-V2) or "top2_sum" (DeepSeek-V3, GLM-4-MoE).
    group_score: Literal["max", "top2_sum"] = "max"
    # Multiplies the final weights (DeepSeek, GLM).
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts ({self.num_experts}) is not a multiple of "
                             f"num_groups ({self.num_groups})")
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups ({self.topk_groups}) must be in 1..num_groups "
                             f"({self.num_groups})")
        if self.scoring not in ("softmax", "sigmoid", "topk_softmax"):
            raise ValueError(f"unknown router scoring {self.scoring!r}")


def route(logits: torch.Tensor, spec: RouterSpec,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``spec.top_k`` experts per token.

    Args:
        logits: ``[T, num_experts]`` router logits (any float dtype; scored in float32).
        spec: the layer's routing rules.
        correction_bias: ``[num_experts]`` added to the scores for the choice only.

    Returns:
        ``(weights [T, k] float32, ids [T, k] int64)``.
    """
    logits = logits.float()
    if spec.scoring == "topk_softmax":
        top, ids = logits.topk(spec.top_k, dim=-1)
        weights = top.softmax(dim=-1)
    else:
        scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if spec.num_groups > 1:
            choice = _mask_groups(choice, spec)
        ids = choice.topk(spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def _mask_groups(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """``choice`` with experts outside each token's best ``topk_groups`` groups at -inf."""
    t = choice.shape[0]
    grouped = choice.view(t, spec.num_groups, -1)
    if spec.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    keep = group_scores.topk(spec.topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    fill = 0.0 if spec.group_score == "max" else float("-inf")
    return grouped.masked_fill(~mask.unsqueeze(-1), fill).view(t, -1)
