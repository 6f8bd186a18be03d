"""Rotary embeddings per rope type against transformers (frequencies, cos/sin, rotation)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from inference_engine.layers.rotary import RotaryEmbedding, inv_frequencies, rope_parameters
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

HEAD_DIM = 16
MAX_POSITION = 256

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
             "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 32},
    "yarn_betas_no_truncate": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                               "beta_fast": 16, "beta_slow": 2, "truncate": False,
                               "attention_factor": 1.3, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "partial_default": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
    "partial_yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                     "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5},
}


def config(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4,
                                    max_position_embeddings=MAX_POSITION,
                                    rope_parameters=dict(rope))


def hf_rotary_class(cfg) -> type:
    """Llama's rotary, or GPT-NeoX's where only part of each head rotates (Llama ignores it)."""
    partial = cfg.rope_parameters.get("partial_rotary_factor", 1.0) < 1.0
    return GPTNeoXRotaryEmbedding if partial else LlamaRotaryEmbedding


def reference_inv_freq(cfg) -> tuple[torch.Tensor, float]:
    fn = ROPE_INIT_FUNCTIONS.get(cfg.rope_parameters["rope_type"])
    if fn is None:  # transformers keeps the default rope on each model's rotary class
        fn = hf_rotary_class(cfg).compute_default_rope_parameters
    return fn(cfg, device="cpu")


def ours(cfg, dtype=torch.float32) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, cfg.max_position_embeddings, rope_parameters(cfg), dtype)


def hf_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' rotation of ``[T, heads, D]`` tensors, partial dims as GLM/Phi do."""
    rot = cos.shape[-1]
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    q_rot, k_rot = apply_rotary_pos_emb(qh[..., :rot], kh[..., :rot], cos, sin)
    q_out = torch.cat([q_rot, qh[..., rot:]], dim=-1)[0].transpose(0, 1)
    k_out = torch.cat([k_rot, kh[..., rot:]], dim=-1)[0].transpose(0, 1)
    return q_out, k_out


@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_and_attention_scaling_match_transformers(case):
    cfg = config(CASES[case])
    params = rope_parameters(cfg)
    ref_inv, ref_scale = reference_inv_freq(cfg)
    rot_dim = int(HEAD_DIM * params["partial_rotary_factor"])
    inv, scale = inv_frequencies(params, rot_dim, cfg.max_position_embeddings)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_cos_sin_and_rotation_match_transformers(case):
    cfg = config(CASES[case])
    rope, hf = ours(cfg), hf_rotary_class(cfg)(cfg)
    positions = torch.tensor([0, 1, 5, 17, 31, 32, 100, MAX_POSITION - 1])
    q, k = torch.randn(len(positions), 4, HEAD_DIM), torch.randn(len(positions), 2, HEAD_DIM)
    cos, sin = hf(q, positions[None])
    table = rope.lookup(positions)
    torch.testing.assert_close(table.cos[:, 0], cos[0], atol=1e-6, rtol=1e-6)
    half = table.sin.shape[-1]
    torch.testing.assert_close(table.sin[:, 0], sin[0, :, half:], atol=1e-6, rtol=1e-6)
    ref_q, ref_k = hf_rotate(q, k, cos, sin)
    # The module's own entry point takes flat [T, heads * D].
    got_q, got_k = rope(positions, q.reshape(len(positions), -1), k.reshape(len(positions), -1))
    assert got_q.shape == (len(positions), 4 * HEAD_DIM)
    torch.testing.assert_close(got_q.view_as(q), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k.view_as(k), ref_k, atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_the_tail_untouched():
    cfg = config(CASES["partial_default"])
    q = torch.randn(3, 2, HEAD_DIM)
    got = ours(cfg).lookup(torch.tensor([1, 2, 3])).rotate(q)
    torch.testing.assert_close(got[..., HEAD_DIM // 2:], q[..., HEAD_DIM // 2:], atol=0, rtol=0)


def test_rotation_accepts_strided_views_of_a_fused_projection():
    cfg = config(CASES["default"])
    rope = ours(cfg)
    qkv = torch.randn(5, (4 + 2 + 2) * HEAD_DIM)
    positions = torch.arange(3, 8)
    q = qkv[:, : 4 * HEAD_DIM]
    k = qkv[:, 4 * HEAD_DIM: 6 * HEAD_DIM]
    got_q, got_k = rope(positions, q, k)
    ref_q, ref_k = rope(positions, q.contiguous(), k.contiguous())
    torch.testing.assert_close(got_q, ref_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, ref_k, atol=0, rtol=0)


def test_dynamic_ntk_matches_transformers_token_by_token_beyond_the_context():
    cfg = config(CASES["dynamic"])
    rope, hf = ours(cfg), LlamaRotaryEmbedding(cfg)
    assert rope.max_position == 2 * MAX_POSITION
    x = torch.randn(1, 1, HEAD_DIM)
    # transformers generating one token at a time: each call sees seq_len = p + 1.
    for p in [MAX_POSITION - 1, MAX_POSITION, MAX_POSITION + 7, 2 * MAX_POSITION - 1]:
        cos, sin = hf(x, torch.tensor([[p]]))
        table = rope.lookup(torch.tensor([p]))
        torch.testing.assert_close(table.cos[:, 0], cos[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(table.sin[:, 0], sin[0, :, HEAD_DIM // 2:], atol=2e-5, rtol=1e-5)


def test_bfloat16_rotation_is_close_to_transformers():
    cfg = config(CASES["llama3"])
    rope, hf = ours(cfg, torch.bfloat16), LlamaRotaryEmbedding(cfg)
    positions = torch.arange(0, 64, 3)
    q = torch.randn(len(positions), 4, HEAD_DIM).bfloat16()
    k = torch.randn(len(positions), 2, HEAD_DIM).bfloat16()
    cos, sin = hf(q, positions[None])
    ref_q, ref_k = hf_rotate(q, k, cos, sin)
    got_q, got_k = rope(positions, q, k)
    assert got_q.dtype == torch.bfloat16
    torch.testing.assert_close(got_q, ref_q, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got_k, ref_k, atol=3e-2, rtol=2e-2)


def test_legacy_rope_scaling_fields_are_read():
    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0},
                             partial_rotary_factor=0.5, max_position_embeddings=64)
    params = rope_parameters(legacy)
    assert params["rope_type"] == "linear" and params["factor"] == 2.0
    assert params["rope_theta"] == 5e5 and params["partial_rotary_factor"] == 0.5
    plain = rope_parameters(SimpleNamespace(max_position_embeddings=64))
    assert (plain["rope_type"], plain["rope_theta"], plain["partial_rotary_factor"]) == (
        "default", 10000.0, 1.0)


def test_yarn_original_context_defaults_to_max_position():
    params = rope_parameters(SimpleNamespace(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
        max_position_embeddings=128))
    assert params["original_max_position_embeddings"] == 128


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="longrope"):
        RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "longrope", "rope_theta": 1e4}, torch.float32)
