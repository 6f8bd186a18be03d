"""Linear layers whose weights belong to the model's quantization method.

A layer only knows its shape and how its output rows split into fused parts
(q/k/v, gate/up); ``ctx.quant_method`` creates the parameters, loads
checkpoint tensors into them and runs the matmul. Fused layers record each
part's row range so a checkpoint's separate tensors land in one matrix and
the forward pass is one matmul.

Tensor parallelism (docs/distributed.md) shards these layers when they are
built inside a TP group (:func:`~inference_engine.distributed.parallel_state.parallel_state`):
column kinds (:class:`ColumnLinear`, :class:`QKVParallelLinear` by heads,
:class:`MergedColumnLinear` each part alike) keep their rank's output rows,
:class:`RowLinear` keeps its rank's input columns and all-reduces its partial
output (bias added once, after the sum). Each layer narrows the full checkpoint
tensor to its rank's slice in :func:`copy_into_rows` (:meth:`LinearBase.tp_shard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from inference_engine.distributed.parallel_state import parallel_state
from inference_engine.interfaces.model import ModelContext

__all__ = [
    "ColumnLinear",
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
    if getattr(layer, "tp_size", 1) > 1:
        loaded = layer.tp_shard(loaded, shard_id)  # type: ignore[attr-defined]
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

    # Tensor-parallel group this layer is split over (1: whole), and this rank in it; set by
    # the column/row subclasses from the process's TP group when they are built.
    tp_size: int = 1
    tp_rank: int = 0
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

    def tp_shard(self, loaded: torch.Tensor, shard_id: ShardId | None) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (the whole tensor: not split)."""
        return loaded

    def _load_bias(self, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: ShardId | None = None) -> None:
        copy_into_rows(self, param, loaded, shard_id, f"{self.prefix}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, K]`` -> ``[num_tokens, N]``."""
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add_delta(x, out)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}"


def _tp_group() -> tuple[int, int]:
    """(rank, size) of the process's tensor-parallel group, read once per layer build."""
    tp = parallel_state().tp
    return tp.rank, tp.size


def _split(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({size})")
    return total // size


class ReplicatedLinear(LinearBase):
    """One projection, never split under tensor parallelism (small heads, routers)."""

    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, prefix: str,
                 bias: bool = False) -> None:
        super().__init__(ctx, input_size, [output_size], prefix, bias)


def _narrow_scaled(loaded: torch.Tensor, dim: int, full: int, start: int, size: int,
                   what: str) -> torch.Tensor:
    """``loaded.narrow(dim, start, size)`` for a tensor spanning ``full`` elements along
    ``dim``, or a proportional slice of one that holds one entry per block of them (block
    scales, packed codes): the slice must fall on block boundaries.

    Raises:
        ValueError: the rank's slice would split a block (names the tensor and sizes).
    """
    have = loaded.shape[dim]
    if have == full:
        return loaded.narrow(dim, start, size)
    if have and full % have == 0 and start % (full // have) == 0 and size % (full // have) == 0:
        unit = full // have
        return loaded.narrow(dim, start // unit, size // unit)
    if have and have % full == 0:  # several entries per element (packed along this dim)
        per = have // full
        return loaded.narrow(dim, start * per, size * per)
    raise ValueError(f"{what}: a tensor of {have} entries over {full} elements cannot be split "
                     f"at [{start}, {start + size}) for tensor parallelism (a block would be "
                     f"split: use a tensor_parallel_size that keeps blocks whole)")


class _ColumnSplit(LinearBase):
    """Column parallelism: each rank keeps rows ``_ckpt_rows[part]`` of each part's
    checkpoint tensor; the output stays split (no collective). Tensors with one entry per
    block of rows (block scales) are cut at the same rows, in blocks."""

    # Part id -> (first row in the checkpoint part, rows kept) on this rank.
    _ckpt_rows: dict[ShardId, tuple[int, int]]
    # Part id -> full rows of the part in the checkpoint.
    _full_rows: dict[ShardId, int]

    def tp_shard(self, loaded: torch.Tensor, shard_id: ShardId | None) -> torch.Tensor:
        if loaded.dim() == 0 or loaded.numel() == 1:  # per-tensor scales: whole everywhere
            return loaded
        if shard_id is not None or len(self.shard_ids) == 1:
            sid = self.shard_ids[0] if shard_id is None else shard_id
            start, size = self._ckpt_rows[sid]
            return _narrow_scaled(loaded, 0, self._full_rows[sid], start, size,
                                  f"{self.prefix} part {sid!r}")
        # A fused checkpoint tensor (every part stacked): cut each part, keep its slice.
        total = sum(self._full_rows.values())
        unit = total / loaded.shape[0]
        pieces, offset = [], 0
        for sid in self.shard_ids:
            start, size = self._ckpt_rows[sid]
            full = self._full_rows[sid]
            part = loaded.narrow(0, int(offset / unit), int(full / unit))
            pieces.append(_narrow_scaled(part, 0, full, start, size, f"{self.prefix}"))
            offset += full
        return torch.cat(pieces)


class RowLinear(LinearBase):
    """Output projections (``o_proj``, ``down_proj``): split along K under tensor
    parallelism; each rank multiplies its input slice and the partial outputs are summed
    (one all-reduce), the bias added once after the sum."""

    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, prefix: str,
                 bias: bool = False) -> None:
        rank, size = _tp_group()
        local = _split(input_size, size, f"{prefix}: input size")
        self.tp_rank, self.tp_size = rank, size
        self.full_input_size = input_size
        super().__init__(ctx, local, [output_size], prefix, bias)
        self._tp = parallel_state().tp

    def tp_shard(self, loaded: torch.Tensor, shard_id: ShardId | None) -> torch.Tensor:
        if loaded.dim() < 2:  # the bias (and per-row scales): whole on every rank
            return loaded
        return _narrow_scaled(loaded, 1, self.full_input_size, self.tp_rank * self.input_size,
                              self.input_size, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, K / tp]`` (this rank's slice) -> ``[num_tokens, N]``, summed."""
        if self.tp_size == 1:
            return super().forward(x)
        out = self.quant_method.apply(self, x, None)
        if self.lora is not None:
            out = self.lora.add_delta(x, out)
        out = self._tp.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)


class ColumnLinear(_ColumnSplit):
    """One projection split along N under tensor parallelism (MLA's per-head projections)."""

    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, prefix: str,
                 bias: bool = False) -> None:
        rank, size = _tp_group()
        local = _split(output_size, size, f"{prefix}: output size")
        self.tp_rank, self.tp_size = rank, size
        self._ckpt_rows = {0: (rank * local, local)}
        self._full_rows = {0: output_size}
        super().__init__(ctx, input_size, [local], prefix, bias)


class QKVParallelLinear(_ColumnSplit):
    """q, k and v projections in one matmul; parts ``"q"``, ``"k"``, ``"v"``.

    Output columns are ``[q (num_heads * head_dim) | k | v (num_kv_heads * head_dim each)]``
    of this rank's heads: under tensor parallelism ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` KV heads, or one KV head (replicated over ``tp / num_kv_heads``
    ranks) when there are fewer KV heads than ranks. ``num_heads``/``num_kv_heads`` are
    this rank's; ``total_num_heads``/``total_num_kv_heads`` the checkpoint's.
    """

    def __init__(self, ctx: ModelContext, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, prefix: str, bias: bool = False) -> None:
        rank, size = _tp_group()
        heads = _split(num_heads, size, f"{prefix}: attention heads")
        if num_kv_heads >= size:
            kv_heads = _split(num_kv_heads, size, f"{prefix}: KV heads")
            kv_start = rank * kv_heads
        else:
            if size % num_kv_heads:
                raise ValueError(f"{prefix}: tensor_parallel_size ({size}) is not a multiple of "
                                 f"the KV heads ({num_kv_heads}) it must replicate")
            kv_heads, kv_start = 1, rank // (size // num_kv_heads)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        self.tp_rank, self.tp_size = rank, size
        self._ckpt_rows = {"q": (rank * q_size, q_size), "k": (kv_start * head_dim, kv_size),
                           "v": (kv_start * head_dim, kv_size)}
        self._full_rows = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                           "v": num_kv_heads * head_dim}
        super().__init__(ctx, hidden_size, [q_size, kv_size, kv_size], prefix, bias,
                         shard_ids=["q", "k", "v"])
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.head_dim = head_dim
        self.q_size = q_size
        self.kv_size = kv_size


class MergedColumnLinear(_ColumnSplit):
    """Several projections of the same input along N (gate and up); parts ``0, 1, ...``.

    Under tensor parallelism each part is split alike, so this rank's rows are
    ``[gate_r; up_r]`` and the gated activation pairs them as on one device.
    """

    def __init__(self, ctx: ModelContext, input_size: int, output_sizes: Sequence[int],
                 prefix: str, bias: bool = False) -> None:
        rank, size = _tp_group()
        local = [_split(n, size, f"{prefix}: part {i} size") for i, n in enumerate(output_sizes)]
        self.tp_rank, self.tp_size = rank, size
        self._ckpt_rows = {i: (rank * n, n) for i, n in enumerate(local)}
        self._full_rows = dict(enumerate(output_sizes))
        super().__init__(ctx, input_size, local, prefix, bias)
