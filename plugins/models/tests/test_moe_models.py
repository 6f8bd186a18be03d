"""MoE architectures against transformers v5: fp32 logits within 1e-4, engine greedy parity.

Each architecture is a tiny random transformers model (2 layers, 8 experts,
top-2, hidden 64), saved and loaded from its safetensors by checkpoint name.
Logits are compared on hand-built steps (one prefill; two sequences in one
flat batch; chunked prefill then a mixed decode + prefill step) for both
attention backends with block size 4; greedy continuations run through the
whole engine with chunked prefill and preemption forced.
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
from inference_engine.layers.mla import MLAAttention
from inference_engine.testing import cpu_llm, train_tiny_tokenizer
from inference_engine.testing_parity import (
    BACKENDS,
    MOE_CONFIGS,
    PARITY_NEW_TOKENS,
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
from inference_engine_models.deepseek_v2 import DeepseekV2ForCausalLM
from inference_engine_models.glm4_moe import Glm4MoeForCausalLM
from inference_engine_models.gpt_oss import GptOssForCausalLM
from inference_engine_models.granitemoe import GraniteMoeForCausalLM
from inference_engine_models.minimax_m2 import MiniMaxM2ForCausalLM
from inference_engine_models.qwen3_moe import Qwen3MoeForCausalLM

torch.set_flush_denormal(True)



# The tiny configs (2 layers, 8 experts, top-2, hidden 64) live in testing_parity.MOE_CONFIGS.
ARCHS: dict[str, tuple[Callable[[int], Any], type]] = {
    "qwen3_moe": (MOE_CONFIGS["qwen3_moe"], Qwen3MoeForCausalLM),
    "granitemoe": (MOE_CONFIGS["granitemoe"], GraniteMoeForCausalLM),
    "glm4_moe": (MOE_CONFIGS["glm4_moe"], Glm4MoeForCausalLM),
    "minimax_m2": (MOE_CONFIGS["minimax_m2"], MiniMaxM2ForCausalLM),
    "gpt_oss": (MOE_CONFIGS["gpt_oss"], GptOssForCausalLM),
    "deepseek_v2": (MOE_CONFIGS["deepseek_v2"], DeepseekV2ForCausalLM),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    """(arch, config, HF model, saved checkpoint tensors)."""
    make_config, _ = ARCHS[request.param]
    config = make_config(256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config))
    return request.param, config, hf, saved_tensors(hf)


def ours(arch: str, config: Any, tensors: dict[str, torch.Tensor], backend: str = "torch_sdpa"):
    return build_twin(ARCHS[arch][1], config, tensors, backend)


def test_checkpoint_has_per_expert_tensors(pair):
    """The saved format (what real checkpoints hold), not transformers' stacked state_dict."""
    arch, _, _, tensors = pair
    expected = {
        "qwen3_moe": "model.layers.0.mlp.experts.7.up_proj.weight",
        "granitemoe": "model.layers.0.block_sparse_moe.input_linear.weight",
        "glm4_moe": "model.layers.1.mlp.experts.7.up_proj.weight",
        "minimax_m2": "model.layers.0.block_sparse_moe.experts.7.w3.weight",
        "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj_bias",
        "deepseek_v2": "model.layers.1.mlp.experts.7.up_proj.weight",
    }[arch]
    assert expected in tensors


def test_single_prefill_matches_transformers(pair):
    arch, config, hf, tensors = pair
    ids = random_tokens(13, 1)
    twin = ours(arch, config, None)
    assert twin.model.load_weights(tensors.items()) == set(tensors)  # by checkpoint name
    for module in twin.model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    logits = run_step(twin, [Seq(ids, 0, [5, 2, 7, 0])])
    assert logits.shape == (13, config.vocab_size)
    assert_logits_close(logits, hf_logits(hf, ids))


def test_stacked_state_dict_loads_too(pair):
    arch, config, hf, _ = pair
    if arch == "minimax_m2":
        pytest.skip("transformers renames MiniMax-M2's block_sparse_moe to mlp in memory only")
    state = {k: v for k, v in hf.state_dict().items()}
    ids = random_tokens(7, 9)
    logits = run_step(ours(arch, config, state), [Seq(ids, 0, [1, 2])])
    assert_logits_close(logits, hf_logits(hf, ids))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_chunked_prefill_then_mixed_decode_step(pair, backend):
    arch, config, hf, tensors = pair
    twin = ours(arch, config, tensors, backend)
    a, b = random_tokens(13, 4), random_tokens(11, 5)
    blocks_a, blocks_b = [6, 1, 12, 4], [2, 10, 7, 14]
    first = run_step(twin, [Seq(a[:12], 0, blocks_a), Seq(b[:6], 0, blocks_b)])
    assert_logits_close(first[:12], hf_logits(hf, a[:12]))
    second = run_step(twin, [Seq(b, 6, blocks_b)])
    assert_logits_close(torch.cat([first[12:], second]), hf_logits(hf, b))
    c = b + random_tokens(2, 6)
    third = run_step(twin, [Seq(a, 12, blocks_a), Seq(c, 11, blocks_b)])
    assert_logits_close(third[:1], hf_logits(hf, a)[12:])
    assert_logits_close(third[1:], hf_logits(hf, c)[11:])
    a2, c2 = a + random_tokens(1, 7), c + random_tokens(1, 8)
    fourth = run_step(twin, [Seq(a2, 13, blocks_a), Seq(c2, 13, blocks_b)])
    assert_logits_close(fourth[:1], hf_logits(hf, a2)[13:])
    assert_logits_close(fourth[1:], hf_logits(hf, c2)[13:])


PER_EXPERT_NAME = {
    "qwen3_moe": "model.layers.1.mlp.experts.3.gate_proj.weight",
    "glm4_moe": "model.layers.1.mlp.experts.3.gate_proj.weight",
    "minimax_m2": "model.layers.1.block_sparse_moe.experts.3.w1.weight",
    "deepseek_v2": "model.layers.1.mlp.experts.3.gate_proj.weight",
}


def test_missing_expert_is_named_by_checkpoint_name(pair):
    arch, config, _, tensors = pair
    if arch not in PER_EXPERT_NAME:
        pytest.skip(f"{arch} checkpoints store experts stacked")
    dropped = PER_EXPERT_NAME[arch]
    with pytest.raises(ValueError, match="1 tensor\\(s\\) missing") as err:
        ours(arch, config, {k: v for k, v in tensors.items() if k != dropped})
    assert dropped in str(err.value)


def test_mla_caches_the_latent_and_both_decode_paths_agree():
    """DeepSeek-V2: the cache holds rank + rope values per token (not per-head K/V), and the
    absorbed-weights decode equals the expanded reference (and transformers)."""
    config = MOE_CONFIGS["deepseek_v2"](256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config))
    tensors = saved_tensors(hf)
    a, b = random_tokens(9, 11), random_tokens(6, 12)
    a2, b2 = a + random_tokens(1, 13), b + random_tokens(1, 14)
    results = {}
    for path in ("absorbed", "expand"):
        twin = build_twin(DeepseekV2ForCausalLM, config, tensors, "paged")
        layers = [m for m in twin.model.modules() if isinstance(m, MLAAttention)]
        assert len(layers) == 2
        assert layers[0].kv_cache_spec() == KVCacheSpec(1, 1, 32 + 8, torch.float32)
        assert twin.pool.specs == [layer.kv_cache_spec() for layer in layers]
        for layer in layers:
            layer.decode_path = path
        run_step(twin, [Seq(a, 0, [3, 5, 7]), Seq(b, 0, [8, 2])])
        results[path] = run_step(twin, [Seq(a2, 9, [3, 5, 7]), Seq(b2, 6, [8, 2])])
    torch.testing.assert_close(results["absorbed"], results["expand"], atol=1e-5, rtol=1e-5)
    assert_logits_close(results["absorbed"][:1], hf_logits(hf, a2)[-1:])
    assert_logits_close(results["absorbed"][1:], hf_logits(hf, b2)[-1:])


# --------------------------------------------------------------------------- #
# The whole engine: batch of prompts, chunked prefill and preemption forced.
# --------------------------------------------------------------------------- #

PROMPTS = PARITY_PROMPTS
NEW_TOKENS = PARITY_NEW_TOKENS


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


# Every architecture on the default backend; the reference backend where attention differs
# (sinks) and on the plain case (MLA attends through its own layer, not the backend).
ENGINE_CASES = [(arch, "paged") for arch in ARCHS] + [("qwen3_moe", "torch_sdpa"),
                                                       ("gpt_oss", "torch_sdpa")]


@pytest.mark.parametrize(("arch", "backend"), ENGINE_CASES)
def test_engine_greedy_parity_with_chunking_and_preemption(arch, backend, tokenizer, tmp_path):
    config = ARCHS[arch][0](len(tokenizer))
    config.eos_token_id, config.pad_token_id, config.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None)
    torch.manual_seed(0)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config), std=0.1)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    hf.config._attn_implementation = "eager"
    hf.generation_config.eos_token_id = None
    # A pool of 16 blocks of 4 tokens, sized from the layers' own cache specs.
    specs = [layer.kv_cache_spec() for layer in attention_layers(build_twin(
        ARCHS[arch][1], config, None).model)]
    block_bytes = KVCachePool.bytes_per_block_for(specs, 4)
    llm = cpu_llm(tmp_path, dtype="float32", show_progress=False, block_size=4,
              max_num_batched_tokens=8, kv_cache_memory=16 * block_bytes,
              attention_backend=backend, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert_greedy_matches(hf, ids, out.outputs[0].token_ids, ref[0, len(ids):].tolist())
