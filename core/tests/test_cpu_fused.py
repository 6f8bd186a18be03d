"""The fused CPU norm / activation kernels against their float64 formulas."""

from __future__ import annotations

import pytest
import torch
from inference_engine.layers.cpu_fused import (
    fused_argmax,
    fused_kernels,
    fused_rms_norm,
    fused_silu_and_mul,
)
from inference_engine.layers.norm import RMSNorm

EPS = 1e-6


def _rms_ref(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """transformers' RMSNorm formula in float64: x * rsqrt(mean(x^2) + eps) * weight."""
    x = x.double()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return out if weight is None else out * weight.double()


def test_kernels_build():
    assert fused_kernels() is not None, "the fused CPU kernels failed to build (see the log)"


@pytest.mark.parametrize("rows", [1, 3, 600])
@pytest.mark.parametrize("width", [1, 17, 512])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_formula(rows, width, with_residual):
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    residual = torch.randn(rows, width, generator=gen) if with_residual else None
    residual_before = None if residual is None else residual.clone()
    out, total = fused_rms_norm(x, weight, EPS, residual)
    summed = x if residual is None else x.double() + residual.double()
    assert torch.allclose(out.double(), _rms_ref(summed, weight), rtol=1e-5, atol=1e-6)
    if with_residual:
        assert torch.allclose(total.double(), summed, rtol=0, atol=1e-6)
        assert torch.equal(residual, residual_before), "the residual input is not written"
    else:
        assert total is None


def test_rms_norm_of_strided_heads_with_per_head_weights():
    """Column slices of a fused qkv output, viewed as heads: q heads and k heads own weights."""
    t, heads, kv_heads, d = 5, 6, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    qk = qkv[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d)
    q_w, k_w = torch.randn(d), torch.randn(d)
    stacked = torch.cat((q_w.expand(heads, d), k_w.expand(kv_heads, d))).contiguous()
    out, _ = fused_rms_norm(qk, stacked, EPS)
    assert out.shape == qk.shape
    assert torch.allclose(out[:, :heads].double(), _rms_ref(qk[:, :heads], q_w), atol=1e-6)
    assert torch.allclose(out[:, heads:].double(), _rms_ref(qk[:, heads:], k_w), atol=1e-6)


def test_rms_norm_module_uses_the_kernel_and_matches_the_torch_path(monkeypatch):
    import inference_engine.layers.norm as norm

    layer = RMSNorm(64, EPS, torch.float32)
    layer.weight.data.normal_()
    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    fused = layer(x, residual)
    monkeypatch.setattr(norm, "fused_rms_norm", lambda *args: None)  # the torch ops
    plain = layer(x, residual)
    assert torch.allclose(fused[0], plain[0], atol=1e-6)
    assert torch.allclose(fused[1], plain[1], atol=0)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 33), (300, 128)])
def test_silu_and_mul_matches_formula(rows, inter):
    gate_up = torch.randn(rows, 2 * inter) * 4
    gate_up[0, 0] = -120.0  # exp overflow side: silu -> -0
    ours = fused_silu_and_mul(gate_up)
    g, u = gate_up.double().chunk(2, dim=-1)
    ref = g * torch.sigmoid(g) * u
    assert torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-6)


def test_other_dtypes_and_shapes_use_torch():
    assert fused_rms_norm(torch.randn(2, 8).to(torch.bfloat16), None, EPS) is None
    assert fused_rms_norm(torch.randn(2, 8).t(), None, EPS) is None  # last dim not contiguous
    assert fused_rms_norm(torch.randn(2, 8), None, EPS, torch.randn(3, 8)) is None
    assert fused_silu_and_mul(torch.randn(2, 3, 8)) is None


@pytest.mark.parametrize("partial", [1.0, 0.5, 0.25])
def test_fused_rope_matches_the_torch_rotation(partial):
    """One-pass rotary against RotaryTable's torch ops (full and partial rotary, strided heads)."""
    import dataclasses

    import transformers
    from inference_engine.layers.cpu_fused import fused_kernels
    from inference_engine.layers.rotary import RotaryEmbedding, rope_parameters

    if fused_kernels() is None:
        pytest.skip("the fused kernels did not build")
    config = transformers.LlamaConfig(head_dim=64, partial_rotary_factor=partial)
    rope = RotaryEmbedding(64, 512, rope_parameters(config), torch.float32)
    table = rope.lookup(torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(1)))
    x = torch.randn(29, 20, 64)[:, 3:15]  # heads taken out of a wider fused projection
    fused = table.rotate(x)
    reference = dataclasses.replace(table, rows=None).rotate(x)
    assert fused.is_contiguous() and fused.shape == x.shape
    torch.testing.assert_close(fused, reference, atol=1e-6, rtol=1e-6)
    assert torch.equal(fused[..., table.rot_dim:], x[..., table.rot_dim:])


@pytest.mark.parametrize("rows", [1, 16, 40])
@pytest.mark.parametrize("width", [1, 63, 64, 65, 8192])
def test_argmax_equals_torch(rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width + 3, generator=gen)[:, 3:]  # strided rows
    x[:, -1] = x.max()  # ties: the first maximum wins
    assert torch.equal(fused_argmax(x), x.argmax(dim=-1))


def test_argmax_special_values_follow_torch():
    x = torch.full((6, 130), -1.0)
    x[0, 70], x[0, 90] = float("nan"), float("nan")  # NaN ranks first; the first NaN
    x[0, 100] = float("inf")
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 5], x[2, 6] = -0.0, 0.0  # -0 == +0: the first
    x[3, 129] = float("inf")
    x[4, 64], x[4, 65] = 3.0, 3.0  # a tie across the kernel's 64-value chunks
    x[5, 1] = 1e-45  # a denormal above -1
    assert torch.equal(fused_argmax(x), x.argmax(dim=-1))
    assert fused_argmax(x.double()) is None and fused_argmax(x[0]) is None
