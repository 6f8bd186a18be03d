"""A GGML tensor's stored form in torch, shared by the linear and the MoE methods.

Block types are held as ``uint8 [rows, row_bytes]`` exactly as the file stores
them; F32/F16/BF16 as float tensors of their own dtype.
"""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType

from inference_engine_gguf.ggml_types import row_bytes

__all__ = ["FLOAT_DTYPES", "empty_raw"]

T = GGMLQuantizationType
# The float types and the torch dtype each is held in.
FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def empty_raw(qtype: GGMLQuantizationType, shape: tuple[int, int],
              device: torch.device | None = None) -> torch.Tensor:
    """An uninitialised stored-form tensor for ``shape = (rows, K)`` values."""
    rows, k = shape
    if qtype in FLOAT_DTYPES:
        return torch.empty(rows, k, dtype=FLOAT_DTYPES[qtype], device=device)
    return torch.empty(rows, row_bytes(qtype, k), dtype=torch.uint8, device=device)
