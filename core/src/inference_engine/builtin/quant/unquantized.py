"""The built-in quantization method: dense weights in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.interfaces.quant import QuantMethod

__all__ = ["UnquantizedMethod", "copy_shard"]


def copy_shard(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard: int | str | None,
               name: str) -> None:
    """Copy a checkpoint tensor into ``param`` (or its rows for one fused shard).

    Raises:
        ValueError: naming the parameter and both shapes when they disagree.
    """
    target = param.data
    if shard is not None:
        offset, size = layer.shard_rows(shard)
        target = target.narrow(0, offset, size)
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch for {name}: checkpoint has {tuple(loaded.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(loaded)


class UnquantizedMethod(QuantMethod):
    """``weight [N, K]`` and ``F.linear``."""

    name = "unquantized"

    def create_weights(
        self,
        layer: nn.Module,
        prefix: str,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype),
                              requires_grad=False)
        weight.weight_loader = lambda p, t, shard=None: copy_shard(  # type: ignore[attr-defined]
            layer, p, t, shard, f"{prefix}.weight")
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
