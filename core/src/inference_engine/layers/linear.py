"""Linear layers whose weights belong to the model's quantization method.

A layer only knows its shape and how its output rows split into fused parts
(q/k/v, gate/up); ``ctx.quant_method`` creates the parameters, loads
checkpoint tensors into them and runs the matmul. Fused layers record each
part's row range so a checkpoint's separate tensors land in one matrix and
the forward pass is one matmul.

Tensor parallelism (distributed.md) will shard these layers: column kinds
(:class:`QKVParallelLinear`, :class:`MergedColumnLinear`) split their output
rows, :class:`RowLinear` splits its input columns and all-reduces. Today
``tp_size`` is always 1; the attribute marks where the split will go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from inference_engine.interfaces.model import ModelContext

__all__ = [
    "LinearBase",
    "MergedColumnLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowLinear",
    "ShardId",
    "copy_into_rows",
]

# Names a fused part: "q"/"k"/"v" for attention projections, 0/1/... otherwise.
ShardId = int | str


def copy_into_rows(
    layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId | None, name: str
) -> None:
    """Copy a checkpoint tensor into ``param``, or into the rows of one fused part.

    Works for any parameter whose first dimension runs over the layer's output
    rows (weights, biases, per-row scales). Scalars and parameters without a
    fused split are copied whole.

    Args:
        layer: the owning linear layer (for ``shard_rows``).
        param: destination parameter.
        loaded: the checkpoint tensor.
        shard_id: which fused part ``loaded`` is, or None for the whole parameter.
        name: the parameter's dotted name, for the error message.

    Raises:
        ValueError: naming the parameter and both shapes when they disagree.
    """
    target = param.data
    where = name
    if shard_id is not None:
        offset, size = layer.shard_rows(shard_id)  # type: ignore[attr-defined]
        target = target.narrow(0, offset, size)
        where = f"{name} (part {shard_id!r}, rows {offset}:{offset + size})"
    if target.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch for {where}: the checkpoint tensor has shape "
            f"{tuple(loaded.shape)}, the model expects {tuple(target.shape)}"
        )
    target.copy_(loaded)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` created, loaded and applied by ``ctx.quant_method``.

    Args:
        ctx: the model context (dtype and quant method).
        input_size: K.
        output_sizes: N of each fused part, in row order.
        prefix: dotted module name, e.g. ``model.layers.0.self_attn.qkv_proj``.
        bias: whether the layer has a bias (owned by the layer, in ``ctx.dtype``).
        shard_ids: the id of each fused part; defaults to ``0, 1, ...``.
    """

    # Tensor-parallel world size this layer is split over (always 1 for now).
    tp_size: int = 1
    # LoRA slots (``inference_engine.lora.layer.LoRALayerSlots``) when LoRA is enabled:
    # their ``add_delta(x, out)`` adds each token's adapter product to the output.
    lora: Any = None

    def __init__(
        self,
        ctx: ModelContext,
        input_size: int,
        output_sizes: Sequence[int],
        prefix: str,
        bias: bool = False,
        shard_ids: Sequence[ShardId] | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        ids = list(shard_ids) if shard_ids is not None else list(range(len(self.output_sizes)))
        if len(ids) != len(self.output_sizes):
            raise ValueError(f"{prefix}: {len(ids)} shard ids for {len(self.output_sizes)} parts")
        self.shard_ids = ids
        offsets = [sum(self.output_sizes[:i]) for i in range(len(ids))]
        self._shard_rows = dict(zip(ids, zip(offsets, self.output_sizes, strict=True), strict=True))
        self.quant_method = ctx.quant_method
        self.quant_method.create_weights(self, prefix, input_size, self.output_sizes, ctx.dtype)
        if bias:
            b = nn.Parameter(torch.empty(self.output_size, dtype=ctx.dtype), requires_grad=False)
            b.weight_loader = self._load_bias  # type: ignore[attr-defined]
            self.bias = b
        else:
            self.register_parameter("bias", None)

    @property
    def is_fused(self) -> bool:
        """Whether the checkpoint stores this layer as several tensors (one per part)."""
        return len(self.shard_ids) > 1

    def shard_rows(self, shard_id: ShardId) -> tuple[int, int]:
        """(first output row, number of rows) of one fused part.

        Raises:
            ValueError: for an id this layer does not have.
        """
        try:
            return self._shard_rows[shard_id]
        except KeyError:
            raise ValueError(
                f"{self.prefix} has no part {shard_id!r}; its parts are {self.shard_ids}"
            ) from None

    def _load_bias(self, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: ShardId | None = None) -> None:
        copy_into_rows(self, param, loaded, shard_id, f"{self.prefix}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, K]`` -> ``[num_tokens, N]``."""
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add_delta(x, out)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """One projection, never split under tensor parallelism (small heads, routers)."""

    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, prefix: str,
                 bias: bool = False) -> None:
        super().__init__(ctx, input_size, [output_size], prefix, bias)


class RowLinear(LinearBase):
    """Output projections (``o_proj``, ``down_proj``); split along K under tensor parallelism."""

    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, prefix: str,
                 bias: bool = False) -> None:
        super().__init__(ctx, input_size, [output_size], prefix, bias)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one matmul; parts ``"q"``, ``"k"``, ``"v"``.

    Output columns are ``[q (num_heads * head_dim) | k | v (num_kv_heads * head_dim each)]``.
    """

    def __init__(self, ctx: ModelContext, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, prefix: str, bias: bool = False) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(ctx, hidden_size, [q_size, kv_size, kv_size], prefix, bias,
                         shard_ids=["q", "k", "v"])
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = q_size
        self.kv_size = kv_size


class MergedColumnLinear(LinearBase):
    """Several projections of the same input along N (gate and up); parts ``0, 1, ...``."""

    def __init__(self, ctx: ModelContext, input_size: int, output_sizes: Sequence[int],
                 prefix: str, bias: bool = False) -> None:
        super().__init__(ctx, input_size, output_sizes, prefix, bias)
