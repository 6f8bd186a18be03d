"""RMSNorm against transformers' LlamaRMSNorm, with and without the fused residual add."""

from __future__ import annotations

import pytest
import torch
from inference_engine.layers.norm import RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm


def pair(size: int, dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm]:
    ref = LlamaRMSNorm(size, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1.0 + 0.3 * torch.randn(size))
    ours = RMSNorm(size, 1e-6, dtype)
    ours.weight.data.copy_(ref.weight.data)
    return ours, ref.to(dtype)


def test_float32_matches_transformers():
    ours, ref = pair(64, torch.float32)
    x = torch.randn(7, 64) * 3
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)
    heads = torch.randn(5, 4, 64)  # per-head use (Qwen3 q/k norm)
    torch.testing.assert_close(ours(heads), ref(heads), atol=1e-6, rtol=1e-6)


def test_bfloat16_matches_transformers_bit_for_bit():
    ours, ref = pair(64, torch.bfloat16)
    x = (torch.randn(9, 64) * 3).bfloat16()
    out = ours(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add_returns_the_new_residual(dtype):
    ours, ref = pair(32, dtype)
    x, residual = torch.randn(5, 32).to(dtype), torch.randn(5, 32).to(dtype)
    out, summed = ours(x, residual)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, ref(x + residual), atol=1e-6, rtol=1e-6)


def test_strided_head_view_is_accepted():
    ours, ref = pair(16, torch.float32)
    qkv = torch.randn(3, 8 * 16)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    torch.testing.assert_close(ours(q), ref(q.contiguous()), atol=1e-6, rtol=1e-6)
