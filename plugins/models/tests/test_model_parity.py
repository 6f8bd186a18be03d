"""Each architecture against transformers, all-position logits in fp32.

Our model is built through a ModelContext, loaded from the HF model's
state_dict, given a small paged cache of its own, and run on hand-built
steps: one prefill, two sequences of different lengths in one flat batch, a
prefill split into two chunks, and a mixed decode + prefill step. Also the
load_weights contract (unexpected, missing and mismatched names).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from inference_engine.builtin.attention.cpu_paged import CpuPagedAttentionBackend
from inference_engine.builtin.attention.torch_sdpa import TorchSDPABackend
from inference_engine.interfaces.attention import KVCacheSpec
from inference_engine.layers import Attention
from inference_engine.testing_parity import (
    Seq,
    Twin,
    assert_logits_close,
    build_twin,
    hf_logits,
    random_tokens,
    run_step,
    tiny_dense_config,
)
from inference_engine_models.llama import LlamaForCausalLM
from inference_engine_models.qwen2 import Qwen2ForCausalLM
from inference_engine_models.qwen3 import Qwen3ForCausalLM

torch.set_flush_denormal(True)

ARCHS: dict[str, tuple[type, type, type]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, Qwen3ForCausalLM),
}
BACKENDS = {"torch_sdpa": TorchSDPABackend, "paged": CpuPagedAttentionBackend}

BLOCK_SIZE = 4
NUM_BLOCKS = 16


def tiny_config(arch: str, **overrides: Any) -> Any:
    return tiny_dense_config(arch, **overrides)


def random_hf_model(arch: str, config: Any, seed: int = 0) -> torch.nn.Module:
    """The HF model with every weight random (biases and norm weights included)."""
    torch.manual_seed(seed)
    model = ARCHS[arch][1](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    return model


def build_ours(arch: str, config: Any, state: dict[str, torch.Tensor] | None = None,
               backend: str = "torch_sdpa", num_blocks: int = NUM_BLOCKS) -> Twin:
    return build_twin(ARCHS[arch][2], config, state, backend, BLOCK_SIZE, num_blocks)


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_rope_llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama_rope_yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 5,
                                       "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}



@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    """(case, arch, config, HF model, its state_dict)."""
    arch, overrides = CASES[request.param]
    config = tiny_config(arch, **overrides)
    hf = random_hf_model(arch, config)
    return request.param, arch, config, hf, hf.state_dict()


def test_single_prefill_matches_transformers(pair):
    _, arch, config, hf, state = pair
    twin = build_ours(arch, config, state)
    ids = random_tokens(13, 1)
    logits = run_step(twin, [Seq(ids, 0, [5, 2, 7, 0])])
    assert logits.dtype == torch.float32 and logits.shape == (13, config.vocab_size)
    assert_logits_close(logits, hf_logits(hf, ids))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_sequences_in_one_flat_batch(pair, backend):
    _, arch, config, hf, state = pair
    twin = build_ours(arch, config, state, backend)
    a, b = random_tokens(9, 2), random_tokens(6, 3)
    logits = run_step(twin, [Seq(a, 0, [3, 9, 1]), Seq(b, 0, [8, 0])])
    assert_logits_close(logits[:9], hf_logits(hf, a))
    assert_logits_close(logits[9:], hf_logits(hf, b))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_chunked_prefill_then_mixed_decode_step(pair, backend):
    _, arch, config, hf, state = pair
    twin = build_ours(arch, config, state, backend)
    a, b = random_tokens(13, 4), random_tokens(11, 5)
    blocks_a, blocks_b = [6, 1, 12, 4], [2, 10, 7, 14]
    # Step 1: a whole, b's first chunk. Step 2: b's second chunk, using the cache.
    first = run_step(twin, [Seq(a[:12], 0, blocks_a), Seq(b[:6], 0, blocks_b)])
    second = run_step(twin, [Seq(b, 6, blocks_b)])
    assert_logits_close(torch.cat([first[12:], second]), hf_logits(hf, b))
    # Step 3: a decodes (decodes come first) while b prefills 2 more tokens.
    c = b + random_tokens(2, 6)
    third = run_step(twin, [Seq(a, 12, blocks_a), Seq(c, 11, blocks_b)])
    assert_logits_close(third[:1], hf_logits(hf, a)[12:])
    assert_logits_close(third[1:], hf_logits(hf, c)[11:])
    # Step 4: both decode one token.
    a2, c2 = a + random_tokens(1, 7), c + random_tokens(1, 8)
    fourth = run_step(twin, [Seq(a2, 13, blocks_a), Seq(c2, 13, blocks_b)])
    assert_logits_close(fourth[:1], hf_logits(hf, a2)[13:])
    assert_logits_close(fourth[1:], hf_logits(hf, c2)[13:])


# --------------------------------------------------------------------------- #
# load_weights contract
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def qwen2_state():
    config = tiny_config("qwen2")
    return config, random_hf_model("qwen2", config).state_dict()


def load(config: Any, state: dict[str, torch.Tensor], arch: str = "qwen2") -> set[str]:
    return build_ours(arch, config).model.load_weights(state.items())


def test_load_weights_consumes_every_checkpoint_name(qwen2_state):
    config, state = qwen2_state
    state = dict(state)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    assert load(config, state) == set(state)


def test_load_weights_lists_unexpected_names(qwen2_state):
    config, state = qwen2_state
    state = dict(state, **{"model.layers.0.mlp.extra.weight": torch.ones(2),
                           "model.bogus": torch.ones(1)})
    with pytest.raises(ValueError, match="2 unexpected") as err:
        load(config, state)
    assert "model.layers.0.mlp.extra.weight" in str(err.value)
    assert "model.bogus" in str(err.value)
    assert "missing" not in str(err.value)


def test_load_weights_lists_missing_names_by_checkpoint_name(qwen2_state):
    config, state = qwen2_state
    dropped = ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.bias",
               "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    state = {k: v for k, v in state.items() if k not in dropped}
    with pytest.raises(ValueError, match="5 tensor\\(s\\) missing") as err:
        load(config, state)
    for name in dropped:
        assert name in str(err.value)
    assert "qkv_proj" not in str(err.value) and "unexpected" not in str(err.value)


def test_load_weights_names_shape_mismatch(qwen2_state):
    config, state = qwen2_state
    state = dict(state, **{"model.layers.0.self_attn.k_proj.weight": torch.ones(16, 64),
                           "model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match="2 shape mismatch") as err:
        load(config, state)
    message = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert "model.layers.0.self_attn.qkv_proj.weight" in message
    assert "(16, 64)" in message and "(32, 64)" in message
    assert "model.norm.weight" in message and "(65,)" in message and "(64,)" in message
    assert "missing" not in message


def test_tied_model_needs_no_lm_head_and_ignores_one():
    config = tiny_config("llama", tie_word_embeddings=True)
    state = random_hf_model("llama", config).state_dict()
    without = {k: v for k, v in state.items() if k != "lm_head.weight"}
    twin = build_ours("llama", config)
    assert twin.model.load_weights(without.items()) == set(without)
    assert twin.model.lm_head.weight is twin.model.model.embed_tokens.weight
    assert build_ours("llama", config).model.load_weights(state.items()) == set(state)


def test_attention_layers_are_found_in_order_with_their_cache_spec():
    config = tiny_config("qwen3", head_dim=32, num_hidden_layers=3)
    twin = build_ours("qwen3", config)
    layers = [m for m in twin.model.modules() if isinstance(m, Attention)]
    assert [m.prefix for m in layers] == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    spec = layers[0].kv_cache_spec()
    assert spec == KVCacheSpec(num_tensors=2, num_heads=2, head_dim=32, dtype=torch.float32)
    pool = twin.pool.storage.untyped_storage().data_ptr()
    for layer in layers:  # bound to views of the one block-contiguous pool
        for cache in layer.kv_cache:
            assert cache.shape == (NUM_BLOCKS, BLOCK_SIZE, 2, 32)
            assert cache.untyped_storage().data_ptr() == pool
