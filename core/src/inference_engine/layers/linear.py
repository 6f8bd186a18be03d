"""Linear layers whose weights belong to the model's quantization method.

Fused layers (q/k/v, gate/up) keep their parts' row offsets so a checkpoint's
separate tensors load into one matmul. Tensor parallelism (distributed.md)
will split these along rows or columns; today tp=1.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_engine.builtin.quant.unquantized import copy_shard
from inference_engine.interfaces.model import ModelContext

__all__ = ["LinearBase", "MergedColumnLinear", "QKVLinear", "ReplicatedLinear", "RowLinear"]


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` created, loaded and applied by ``ctx.quant_method``."""

    def __init__(
        self,
        ctx: ModelContext,
        input_size: int,
        output_sizes: list[int],
        prefix: str,
        bias: bool = False,
        shard_names: list[str | int] | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        names = shard_names if shard_names is not None else list(range(len(output_sizes)))
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self._shards = {n: (o, s) for n, o, s in zip(names, offsets, output_sizes, strict=True)}
        self.quant_method = ctx.quant_method
        self.quant_method.create_weights(self, prefix, input_size, self.output_sizes, ctx.dtype)
        if bias:
            b = nn.Parameter(torch.empty(self.output_size, dtype=ctx.dtype), requires_grad=False)
            b.weight_loader = lambda p, t, shard=None: copy_shard(  # type: ignore[attr-defined]
                self, p, t, shard, f"{prefix}.bias")
            self.bias = b
        else:
            self.register_parameter("bias", None)

    def shard_rows(self, shard: int | str) -> tuple[int, int]:
        """(row offset, rows) of one fused part."""
        try:
            return self._shards[shard]
        except KeyError:
            raise ValueError(f"{self.prefix} has no shard {shard!r}; shards: {list(self._shards)}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, prefix: str,
                 bias: bool = False) -> None:
        super().__init__(ctx, input_size, [output_size], prefix, bias)


class RowLinear(ReplicatedLinear):
    """Output projections (o_proj, down_proj): split along K under tensor parallelism."""


class QKVLinear(LinearBase):
    """q, k and v projections fused into one matmul; shards "q", "k", "v"."""

    def __init__(self, ctx: ModelContext, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, prefix: str, bias: bool = False) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(ctx, hidden, sizes, prefix, bias, shard_names=["q", "k", "v"])


class MergedColumnLinear(LinearBase):
    """Several projections of the same input fused along N (gate and up); shards 0, 1, ..."""
