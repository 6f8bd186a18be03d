"""Torch dequantization equals the ``gguf`` package's numpy dequantization, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.ggml_types import (
    SUPPORTED_TYPES,
    UnsupportedGGMLTypeError,
    check_supported,
)
from inference_engine_gguf.testing import F16_FIELDS, random_ggml_rows

T = GGMLQuantizationType

BLOCK_TYPES = [t for t in SUPPORTED_TYPES if t in F16_FIELDS]
QUANTIZABLE = [t for t in BLOCK_TYPES if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                                               getattr(T, "MXFP4", None))]


crafted_blocks = random_ggml_rows


def assert_bitwise_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    ours_np = ours.numpy()
    assert ours_np.shape == ref.shape
    assert ours_np.dtype == np.float32
    diff = ours_np.view(np.uint32) != ref.astype(np.float32).view(np.uint32)
    assert not diff.any(), f"{int(diff.sum())} values differ, first at {np.argwhere(diff)[0]}"


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_crafted_blocks_match_gguf_reference(qtype):
    raw = crafted_blocks(qtype, rows=6, blocks_per_row=3, seed=int(qtype))
    ref = quants.dequantize(raw, qtype)
    assert_bitwise_equal(dequantize(torch.from_numpy(raw), qtype), ref)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_blocks_match_gguf_reference(qtype):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((8, 256)).astype(np.float32)
    raw = quants.quantize(values, qtype)
    ref = quants.dequantize(raw, qtype)
    assert_bitwise_equal(dequantize(torch.from_numpy(raw), qtype), ref)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_match_gguf_reference(qtype):
    rng = np.random.default_rng(2)
    values = (rng.standard_normal((4, 64)) * 3).astype(np.float32)
    stored = quants.quantize(values, qtype)  # float32 / float16 array / bf16 bytes
    ref = quants.dequantize(stored, qtype)
    assert_bitwise_equal(dequantize(torch.from_numpy(np.ascontiguousarray(stored)), qtype), ref)


def test_leading_dims_are_kept():
    raw = crafted_blocks(T.Q4_K, rows=6, blocks_per_row=2, seed=3)
    ours = dequantize(torch.from_numpy(raw).reshape(2, 3, -1), T.Q4_K)
    assert ours.shape == (2, 3, 512)
    assert_bitwise_equal(ours.reshape(6, 512), quants.dequantize(raw, T.Q4_K))


@pytest.mark.parametrize("name", ["IQ2_XXS", "Q8_K", "TQ1_0"])
def test_unsupported_type_is_named(name):
    with pytest.raises(UnsupportedGGMLTypeError, match=name) as err:
        check_supported(T[name], "blk.0.attn_q.weight")
    assert "blk.0.attn_q.weight" in str(err.value) and "Q4_K" in str(err.value)
