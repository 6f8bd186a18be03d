"""Test helpers of the FP8 methods: load a checkpoint folder through the engine, run one prefill.

Kept in the package (tests cannot import each other under
``--import-mode=importlib``). Nothing here is used at run time.
"""

from __future__ import annotations

from typing import Any

import torch
from inference_engine.builtin.platforms.cpu import CpuPlatform
from inference_engine.config import ModelConfig, QuantConfig
from inference_engine.engine.loader import LoadedModel, load_model
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.layers import Attention

__all__ = ["load_for_test", "prefill_logits"]

_BLOCK = 16


def load_for_test(path: str, quantization: str | None = None, dtype: str = "float32",
                  platform: Any = None, dequantize_at_load: bool = False) -> LoadedModel:
    """The engine's loader on ``path`` (CPU, ``torch_sdpa`` attention), with a KV cache bound."""
    loaded = load_model(
        ModelConfig(model=path, dtype=dtype, attention_backend="torch_sdpa"),
        QuantConfig(method=quantization, dequantize_at_load=dequantize_at_load),
        platform or CpuPlatform(), show_progress=False,
    )
    for layer in loaded.model.modules():
        if isinstance(layer, Attention):
            shape = (8, _BLOCK, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = (torch.zeros(shape, dtype=loaded.dtype),
                              torch.zeros(shape, dtype=loaded.dtype))
    return loaded


def prefill_logits(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), vocab]`` of one prefill of one sequence."""
    n = len(token_ids)
    if n > 8 * _BLOCK:
        raise ValueError(f"prefill_logits: at most {8 * _BLOCK} tokens, got {n}")
    blocks = list(range(-(-n // _BLOCK)))
    slot = torch.arange(n, dtype=torch.int64)
    metadata = AttentionMetadata(
        num_tokens=n, num_decodes=1 if n == 1 else 0,
        query_start_loc=torch.tensor([0, n], dtype=torch.int64),
        seq_lens=torch.tensor([n], dtype=torch.int64), slot_mapping=slot,
        block_tables=torch.tensor([blocks], dtype=torch.int64), block_size=_BLOCK,
        query_lens_list=[n], seq_lens_list=[n], slot_blocks=slot // _BLOCK,
        slot_offsets=slot % _BLOCK, max_decode_seq_len=n if n == 1 else 0,
    )
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(token_ids), torch.arange(n), metadata)
        return loaded.model.compute_logits(hidden).float()
