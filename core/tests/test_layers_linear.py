"""Fused linear layers with the unquantized method, and the attention layer wrapper."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from inference_engine.interfaces.attention import AttentionBackend, KVCacheSpec
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import (
    Attention,
    MergedColumnLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowLinear,
)


class RecordingBackend(AttentionBackend):
    """Returns its query flattened and records what it was given."""

    def forward(self, query, key, value, kv_cache, metadata):
        self.seen = (query, key, value, kv_cache, metadata)
        return query.reshape(query.shape[0], -1)


def make_ctx(dtype: torch.dtype = torch.float32) -> ModelContext:
    return ModelContext(None, dtype, UnquantizedMethod(), RecordingBackend, torch.device("cpu"))


def test_qkv_parts_load_into_one_matmul():
    layer = QKVParallelLinear(make_ctx(), 16, num_heads=4, num_kv_heads=2, head_dim=4,
                              prefix="attn.qkv_proj", bias=True)
    assert layer.weight.shape == (32, 16) and layer.is_fused
    parts = {"q": (16, 16), "k": (8, 16), "v": (8, 16)}
    weights = {s: torch.randn(shape) for s, shape in parts.items()}
    biases = {s: torch.randn(shape[0]) for s, shape in parts.items()}
    for s in ("v", "q", "k"):  # any order
        layer.weight.weight_loader(layer.weight, weights[s], s)
        layer.bias.weight_loader(layer.bias, biases[s], s)
    x = torch.randn(3, 16)
    expected = torch.cat([F.linear(x, weights[s], biases[s]) for s in ("q", "k", "v")], dim=-1)
    torch.testing.assert_close(layer(x), expected)
    assert layer.shard_rows("k") == (16, 8)


def test_merged_gate_up_parts_and_single_layers():
    ctx = make_ctx()
    merged = MergedColumnLinear(ctx, 8, [12, 12], "mlp.gate_up_proj")
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    merged.weight.weight_loader(merged.weight, up, 1)
    merged.weight.weight_loader(merged.weight, gate, 0)
    x = torch.randn(2, 8)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
    for cls in (RowLinear, ReplicatedLinear):
        single = cls(ctx, 8, 5, "proj")
        w = torch.randn(5, 8)
        single.weight.weight_loader(single.weight, w)
        assert not single.is_fused and single.bias is None
        torch.testing.assert_close(single(x), x @ w.T)


def test_weights_take_the_context_dtype():
    layer = RowLinear(make_ctx(torch.bfloat16), 8, 4, "o_proj", bias=True)
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    layer.weight.weight_loader(layer.weight, torch.randn(4, 8))  # fp32 checkpoint is cast


def test_unquantized_loader_names_parameter_and_both_shapes_on_mismatch():
    layer = QKVParallelLinear(make_ctx(), 16, 4, 2, 4, "model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError) as err:
        layer.weight.weight_loader(layer.weight, torch.randn(9, 16), "k")
    message = str(err.value)
    assert "model.layers.0.self_attn.qkv_proj.weight" in message and "'k'" in message
    assert "(9, 16)" in message and "(8, 16)" in message
    single = RowLinear(make_ctx(), 8, 4, "model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"down_proj\.weight.*\(4, 9\).*\(4, 8\)"):
        single.weight.weight_loader(single.weight, torch.randn(4, 9))


def test_processing_after_loading_keeps_results_and_the_loader():
    layer = QKVParallelLinear(make_ctx(), 16, 4, 2, 4, "qkv_proj", bias=True)
    for s, rows in (("q", 16), ("k", 8), ("v", 8)):
        layer.weight.weight_loader(layer.weight, torch.randn(rows, 16), s)
        layer.bias.weight_loader(layer.bias, torch.randn(rows), s)
    x = torch.randn(5, 16)
    before = layer(x)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.shape == (32, 16)
    torch.testing.assert_close(layer(x), before)
    new_k = torch.randn(8, 16)
    layer.weight.weight_loader(layer.weight, new_k, "k")
    torch.testing.assert_close(layer.weight[16:24], new_k, atol=0, rtol=0)


def test_unknown_part_is_refused():
    layer = MergedColumnLinear(make_ctx(), 8, [4, 4], "mlp.gate_up_proj")
    with pytest.raises(ValueError, match="no part 'q'"):
        layer.weight.weight_loader(layer.weight, torch.randn(4, 8), "q")


def test_attention_layer_views_flat_inputs_and_calls_its_backend():
    ctx = make_ctx()
    attn = Attention(ctx, num_heads=4, head_dim=8, num_kv_heads=2, scale=0.5, prefix="l0.attn",
                     sliding_window=16)
    assert isinstance(attn.backend, RecordingBackend)
    assert (attn.backend.num_heads, attn.backend.num_kv_heads, attn.backend.scale,
            attn.backend.sliding_window) == (4, 2, 0.5, 16)
    assert attn.kv_cache_spec() == KVCacheSpec(num_tensors=2, num_heads=2, head_dim=8,
                                               dtype=torch.float32)
    qkv = torch.randn(3, 64)
    q, k, v = qkv[:, :32], qkv[:, 32:48], qkv[:, 48:]
    with pytest.raises(RuntimeError, match="l0.attn: no KV cache bound"):
        attn(q, k, v, None)
    attn.kv_cache = (torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8))
    out = attn(q, k, v, None)
    query, key, value, cache, _ = attn.backend.seen
    assert query.shape == (3, 4, 8) and key.shape == value.shape == (3, 2, 8)
    assert query.data_ptr() == q.data_ptr() and value.data_ptr() == v.data_ptr()  # views
    assert cache is attn.kv_cache and out.shape == (3, 32)


def test_attention_refuses_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(make_ctx(), 6, 8, 4, 1.0, "l0.attn")
