"""Block-quantized weights under tensor parallelism: a rank's slice must hold whole blocks.

A row-parallel layer (:class:`~inference_engine.layers.linear.RowLinear`) gives each rank
``K / tp`` input columns. Formats that quantize along K in blocks (MXFP4's 32 values, a GGML
type's 32 or 256) can only be cut at block boundaries; otherwise a block's scale would
serve two ranks. Checked once when the layer is built, so a bad shard is refused by name
before anything loads. Column-parallel layers cut output rows, which never splits a block
along K.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_row_shard_blocks", "split_blocks_along_k"]


def check_row_shard_blocks(layer: nn.Module, block_size: int, what: str) -> None:
    """Refuse a row-parallel layer whose per-rank input slice would cut a ``block_size`` block.

    Args:
        layer: a linear layer being built (its ``input_size`` is already this rank's).
        block_size: values per block along K.
        what: the format, for the message (``"MXFP4"``, ``"GGUF Q4_K"``).

    Raises:
        ValueError: naming the layer, the block size and the per-rank slice.
    """
    tp = getattr(layer, "tp_size", 1)
    full = getattr(layer, "full_input_size", None)
    if tp == 1 or full is None:
        return
    local = layer.input_size
    if local % block_size:
        raise ValueError(
            f"{layer.prefix}: {what} blocks hold {block_size} input values, but "
            f"tensor_parallel_size {tp} gives each rank {local} of the {full} input columns, "
            f"which would cut a block; use a tensor_parallel_size that divides "
            f"{full // block_size if full % block_size == 0 else full / block_size} blocks "
            f"evenly (or run this checkpoint on one device)")


def split_blocks_along_k(layer: nn.Module, loaded: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """This rank's input columns of a row-parallel ``[N, blocks * block_bytes]`` byte tensor
    (GGML rows): viewed as ``[N, blocks, block_bytes]``, the rank's whole blocks kept."""
    rows = loaded.shape[0]
    blocks = loaded.reshape(rows, -1, block_bytes)
    return layer.tp_shard(blocks, None).reshape(rows, -1)
