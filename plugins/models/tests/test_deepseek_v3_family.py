"""DeepSeek-V3, DeepSeek-V3.2 (DSA indexer) and GLM-5 (glm_moe_dsa) against transformers v5.

Tiny random models (2-3 layers, 8 experts, hidden 64), saved and loaded by
checkpoint name. fp32 logits are compared on hand-built steps (one prefill;
chunked prefill then mixed decode + prefill steps); greedy continuations run
through the whole engine with a tiny token budget (chunked prefill), a tiny
pool (preemption forced) and with the prefix cache. The sparse models keep the
top 8 keys per query out of prompts of 13+ tokens, so the selection matters
(a dense twin differs); they use 32 indexer heads, as with few heads the ReLU
scores tie at 0 and transformers' ``topk`` breaks ties arbitrarily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.engine.model_runner import attention_layers
from inference_engine.interfaces.attention import KVCacheSpec
from inference_engine.layers.dsa_indexer import LightningIndexer
from inference_engine.testing import cpu_llm, train_tiny_tokenizer
from inference_engine.testing_parity import (
    PARITY_PROMPTS,
    Seq,
    assert_greedy_matches,
    assert_logits_close,
    build_twin,
    hf_logits,
    random_tokens,
    randomize,
    run_step,
    saved_tensors,
)
from inference_engine_models.deepseek_v3 import DeepseekV3ForCausalLM
from inference_engine_models.deepseek_v32 import DeepseekV32ForCausalLM
from inference_engine_models.glm_moe_dsa import GlmMoeDsaForCausalLM

torch.set_flush_denormal(True)

NEW_TOKENS = 24

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
               intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
               n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4,
               topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5,
               kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12)


def _deepseek_v3(vocab: int, **overrides: Any) -> Any:
    return transformers.DeepseekV3Config(vocab_size=vocab, num_hidden_layers=2,
                                         **{**_COMMON, **overrides})


# The sparse models (sizes from shared/docs/headline-models.md): top-8 of 13+ keys, 32 indexer
# heads so the ReLU scores do not tie.
_DSA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, index_n_heads=32, index_head_dim=16, index_topk=8)


def _deepseek_v32(vocab: int, **overrides: Any) -> Any:
    return transformers.DeepseekV32Config(vocab_size=vocab, num_hidden_layers=2,
                                          **{**_COMMON, **_DSA, **overrides})


def _glm_moe_dsa(vocab: int, **overrides: Any) -> Any:
    return transformers.GlmMoeDsaConfig(vocab_size=vocab, num_hidden_layers=3,
                                        indexer_types=["full", "shared", "full"],
                                        **{**_COMMON, **_DSA, **overrides})


ARCHS: dict[str, tuple[Callable[[int], Any], type]] = {
    "deepseek_v3": (_deepseek_v3, DeepseekV3ForCausalLM),
    "deepseek_v3_half_rope": (lambda v: _deepseek_v3(v, rope_interleave=False),
                              DeepseekV3ForCausalLM),
    "deepseek_v32": (_deepseek_v32, DeepseekV32ForCausalLM),
    "glm_moe_dsa": (_glm_moe_dsa, GlmMoeDsaForCausalLM),
}
SPARSE = {"deepseek_v32": _deepseek_v32, "glm_moe_dsa": _glm_moe_dsa}


def hf_model(config: Any, std: float = 0.15) -> Any:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), std=std)


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    """(arch, config, HF model, saved checkpoint tensors)."""
    config = ARCHS[request.param][0](256)
    hf = hf_model(config)
    return request.param, config, hf, saved_tensors(hf)


def ours(arch: str, config: Any, tensors: dict[str, torch.Tensor] | None,
         num_blocks: int = 16):
    return build_twin(ARCHS[arch][1], config, tensors, "paged", num_blocks=num_blocks)


def test_single_prefill_matches_transformers(pair):
    arch, config, hf, tensors = pair
    ids = random_tokens(13, 1)
    twin = ours(arch, config, None)
    assert twin.model.load_weights(tensors.items()) == set(tensors)  # by checkpoint name
    for module in twin.model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    logits = run_step(twin, [Seq(ids, 0, [5, 2, 7, 0])])
    assert_logits_close(logits, hf_logits(hf, ids))


def test_chunked_prefill_then_mixed_decode_steps(pair):
    arch, config, hf, tensors = pair
    twin = ours(arch, config, tensors)
    a, b = random_tokens(13, 4), random_tokens(11, 5)
    blocks_a, blocks_b = [6, 1, 12, 4, 9], [2, 10, 7, 14]
    first = run_step(twin, [Seq(a[:12], 0, blocks_a), Seq(b[:6], 0, blocks_b)])
    assert_logits_close(first[:12], hf_logits(hf, a[:12]))
    second = run_step(twin, [Seq(b, 6, blocks_b)])
    assert_logits_close(torch.cat([first[12:], second]), hf_logits(hf, b))
    c = b + random_tokens(2, 6)
    third = run_step(twin, [Seq(a, 12, blocks_a), Seq(c, 11, blocks_b)])
    assert_logits_close(third[:1], hf_logits(hf, a)[12:])
    assert_logits_close(third[1:], hf_logits(hf, c)[11:])
    a2, c2 = a + random_tokens(4, 7), c + random_tokens(1, 8)
    fourth = run_step(twin, [Seq(c2, 13, blocks_b), Seq(a2, 13, blocks_a)])
    assert_logits_close(fourth[:1], hf_logits(hf, c2)[13:])
    assert_logits_close(fourth[1:], hf_logits(hf, a2)[13:])


def test_sigmoid_router_checkpoint_names(pair):
    """The correction bias sits on the gate; the first layer is dense, the second MoE."""
    _, _, _, tensors = pair
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in tensors
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in tensors
    assert "model.layers.0.mlp.gate_proj.weight" in tensors


def test_sparse_layers_cache_an_indexer_key_per_token(pair):
    """The indexer is a cache layer of its own: one index_head_dim key per token, beside the
    MLA latent in the same pool; GLM-5's shared layer has no indexer weights or cache."""
    arch, config, _, tensors = pair
    if arch not in SPARSE:
        pytest.skip("dense attention")
    twin = ours(arch, config, tensors)
    indexers = [m for m in twin.model.modules() if isinstance(m, LightningIndexer)]
    full = [i for i in range(config.num_hidden_layers)
            if getattr(config, "indexer_types", None) is None
            or config.indexer_types[i] == "full"]
    assert [m.prefix for m in indexers] == [f"model.layers.{i}.self_attn.indexer" for i in full]
    assert KVCacheSpec(1, 1, 16, torch.float32) in twin.pool.specs
    assert len(twin.pool.specs) == config.num_hidden_layers + len(full)
    if arch == "glm_moe_dsa":
        assert not any(name.startswith("model.layers.1.self_attn.indexer") for name in tensors)


def test_selection_matters(pair):
    """A dense twin (top-k past the context) differs from the sparse model, and only the
    sparse one matches transformers' sparse reference: the restriction is really applied."""
    arch, config, hf, tensors = pair
    if arch not in SPARSE:
        pytest.skip("dense attention")
    ids = random_tokens(24, 3)
    sparse = run_step(ours(arch, config, tensors), [Seq(ids, 0, [5, 2, 7, 0, 9, 11])])
    dense_config = SPARSE[arch](256, index_topk=1000)
    dense = run_step(ours(arch, dense_config, tensors), [Seq(ids, 0, [5, 2, 7, 0, 9, 11])])
    assert (sparse - dense).abs().max() > 0.05
    assert_logits_close(sparse, hf_logits(hf, ids))


def test_long_decode_reads_only_selected_positions(pair):
    """Decode steps past top-k (sparse absorbed path) match transformers one token at a time."""
    arch, config, hf, tensors = pair
    if arch not in SPARSE:
        pytest.skip("dense attention")
    twin = ours(arch, config, tensors)
    a, b = random_tokens(10, 21), random_tokens(7, 22)
    blocks_a, blocks_b = [3, 8, 1, 12, 14, 0], [6, 2, 9, 4, 15]
    run_step(twin, [Seq(a, 0, blocks_a), Seq(b, 0, blocks_b)])
    for step in range(8):
        a, b = a + random_tokens(1, 30 + step), b + random_tokens(1, 40 + step)
        logits = run_step(twin, [Seq(b, len(b) - 1, blocks_b), Seq(a, len(a) - 1, blocks_a)])
        assert_logits_close(logits[:1], hf_logits(hf, b)[-1:])
        assert_logits_close(logits[1:], hf_logits(hf, a)[-1:])


def test_fp8_indexer_changes_only_the_selection(pair):
    """With ``indexer_dtype="fp8"`` the index cache holds e4m3 codes + a float32 scale per
    token, and queries whose context fits in top-k (nothing to select) are unchanged; later
    ones differ only through the selection (measured: see docs/models.md)."""
    arch, config, hf, tensors = pair
    if arch not in SPARSE:
        pytest.skip("dense attention")
    fp8_config = SPARSE[arch](256, indexer_dtype="fp8")
    twin = ours(arch, fp8_config, tensors)
    assert KVCacheSpec(1, 1, 16 + 4, torch.uint8) in twin.pool.specs
    ids = random_tokens(24, 3)
    logits = run_step(twin, [Seq(ids, 0, [5, 2, 7, 0, 9, 11])])
    assert torch.isfinite(logits).all()
    top_k = config.index_topk
    assert_logits_close(logits[:top_k], hf_logits(hf, ids)[:top_k])


# --------------------------------------------------------------------------- #
# The whole engine: chunked prefill, preemption, prefix caching.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


def saved_model(arch: str, tokenizer: Any, path: Any) -> Any:
    config = ARCHS[arch][0](len(tokenizer))
    config.eos_token_id, config.pad_token_id, config.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None)
    hf = hf_model(config, std=0.1)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf.generation_config.eos_token_id = None
    return hf


def block_bytes(arch: str, config: Any) -> int:
    specs = [layer.kv_cache_spec()
             for layer in attention_layers(build_twin(ARCHS[arch][1], config, None).model)]
    return KVCachePool.bytes_per_block_for(specs, 4)


def assert_engine_matches(hf: Any, tokenizer: Any, prompts: list[str], outs: Any) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert_greedy_matches(hf, ids, out.outputs[0].token_ids, ref[0, len(ids):].tolist())


ENGINE_ARCHS = [a for a in ARCHS if a != "deepseek_v3_half_rope"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_engine_greedy_parity_with_chunking_and_preemption(arch, tokenizer, tmp_path):
    hf = saved_model(arch, tokenizer, tmp_path)
    llm = cpu_llm(tmp_path, dtype="float32", block_size=4, max_num_batched_tokens=8,
                  kv_cache_memory=20 * block_bytes(arch, hf.config),
                  enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(PARITY_PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert_engine_matches(hf, tokenizer, PARITY_PROMPTS, outs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_engine_greedy_parity_with_prefix_cache_hits(arch, tokenizer, tmp_path):
    """The second wave shares the first's prompt prefix: its cached blocks (latents and,
    for the sparse models, indexer keys) are reused, and the tokens still match."""
    hf = saved_model(arch, tokenizer, tmp_path)
    llm = cpu_llm(tmp_path, dtype="float32", block_size=4, max_num_batched_tokens=64,
                  enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    stem = PARITY_PROMPTS[1]
    llm.generate([stem], params)
    prompts = [stem + " tokens", stem + " blocks of"]
    outs = llm.generate(prompts, params)
    assert llm.engine.blocks.stats.hit_tokens > 0
    assert_engine_matches(hf, tokenizer, prompts, outs)
