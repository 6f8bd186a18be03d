"""Per-expert load of a model's MoE layers (what an expert-placement balancer reads).

Each :class:`~inference_engine.layers.moe.layer.FusedMoE` built under tensor or expert
parallelism counts the (token, slot) assignments its router sends to each expert
(``expert_load``); every rank routes every token, so rank 0's counts are the job's.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["expert_load"]

_LAYER = re.compile(r"layers\.(\d+)\.")


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Decoder layer index -> assignments per expert, for the MoE layers that count ({}
    when none does: a single device)."""
    from inference_engine.layers.moe.layer import FusedMoE

    result: dict[int, list[int]] = {}
    for index, module in enumerate(m for m in model.modules() if isinstance(m, FusedMoE)):
        if module.counts_load:
            match = _LAYER.search(module.prefix)
            result[int(match.group(1)) if match else index] = module.expert_load.tolist()
    return result
