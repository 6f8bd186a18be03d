"""Rotary frequencies per rope type against transformers' ROPE_INIT_FUNCTIONS; RMSNorm vs HF."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from inference_engine.layers.norm import RMSNorm
from inference_engine.layers.rotary import RotaryEmbedding, inv_frequencies, rope_parameters

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
             "original_max_position_embeddings": 256},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def config(rope):
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                                    rope_parameters=dict(rope))


@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_and_scaling_match_transformers(case):
    cfg = config(CASES[case])
    params = rope_parameters(cfg)
    fn = ROPE_INIT_FUNCTIONS.get(params["rope_type"])
    if fn is None:  # transformers keeps the default rope outside the table
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        fn = LlamaRotaryEmbedding.compute_default_rope_parameters
    ref_inv, ref_scale = fn(cfg, device="cpu")
    inv, scale = inv_frequencies(params, 16, cfg.max_position_embeddings)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_rotation_matches_transformers_apply_rotary():
    cfg = config(CASES["llama3"])
    params = rope_parameters(cfg)
    rope = RotaryEmbedding(16, 1024, params, torch.float32)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 5, 17, 300])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    cos, sin = hf(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_tail_untouched():
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    rope = RotaryEmbedding(16, 64, params, torch.float32)
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    got_q, _ = rope(torch.tensor([1, 2, 3]), q, k)
    torch.testing.assert_close(got_q[..., 8:], q[..., 8:])
    # The rotated half is the standard rotation of an 8-dim head.
    full = RotaryEmbedding(8, 64, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    ref, _ = full(torch.tensor([1, 2, 3]), q[..., :8].contiguous(), k[..., :8].contiguous())
    torch.testing.assert_close(got_q[..., :8], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    x = torch.randn(5, 32).to(dtype)
    ref = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(32, 1e-6)
    ours.weight.data.copy_(ref.weight.data)
    ref, ours = ref.to(dtype), ours.to(dtype)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)
    residual = torch.randn(5, 32).to(dtype)
    out, summed = ours(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out, ref(x + residual), atol=1e-6 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)
