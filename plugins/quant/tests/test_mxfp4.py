"""mxfp4 end to end: gpt-oss-style checkpoints and online quantization against transformers.

Checkpoints are built from a tiny random Qwen3/Llama with the spec's formulas
(:mod:`inference_engine_quant.mx_testing`, independent of the engine's codecs);
the reference is transformers running the same dequantized weights. With the
same weights and unquantized activations float32 logits must agree within
1e-4 (only summation order differs); greedy tokens must agree except at a
reference near-tie (top-2 logits within 1e-4).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.builtin.platforms.cpu import CpuPlatform
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_parity import assert_greedy_matches
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.mx_block import dequantize_mxfp4
from inference_engine_quant.mx_linear import quantized_weight_bytes
from inference_engine_quant.mx_testing import (
    ref_dequantized_online,
    ref_mxfp4,
    write_quantized_checkpoint,
)
from inference_engine_quant.mxfp4 import Mxfp4Method

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]
ATOL = 1e-4
SMALL_KV = 1 << 22


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float(), model


def hf_greedy(model, ids, n):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", intermediate_size=96)


@pytest.fixture(scope="module")
def gpt_oss_style(tmp_path_factory, qwen3_dir):
    """(quantized dir, dequantized dir): MLP layers MXFP4, attention excluded as gpt-oss does."""
    root = tmp_path_factory.mktemp("mxfp4_ckpt")

    def quantize(module, w):
        if ".self_attn." in module:
            return None
        blocks, scales, deq = ref_mxfp4(w)
        return {".weight_blocks": blocks, ".weight_scales": scales}, deq

    config = {"quant_method": "mxfp4",
              "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens",
                                         "lm_head"]}
    write_quantized_checkpoint(qwen3_dir, root / "q", root / "dq", quantize, config)
    return root / "q", root / "dq"


def test_gpt_oss_style_checkpoint_logits_match_transformers_on_dequantized_weights(gpt_oss_style):
    qdir, dqdir = gpt_oss_style
    loaded = load_for_test(str(qdir))
    assert isinstance(loaded.model.model.layers[0].mlp.gate_up_proj.quant_method, Mxfp4Method)
    layer0 = loaded.model.model.layers[0]
    assert layer0.mlp.down_proj.linear_format.name == "mxfp4"
    assert layer0.self_attn.qkv_proj.linear_format.name == "dense"  # modules_to_not_convert
    ref, _ = hf_logits(dqdir, TOKENS)
    ours = prefill_logits(loaded, TOKENS)
    assert (ours - ref).abs().max() < ATOL


def test_gpt_oss_style_checkpoint_greedy_through_the_engine(gpt_oss_style):
    qdir, dqdir = gpt_oss_style
    llm = cpu_llm(str(qdir), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV,
              block_size=4)
    prompts = [TOKENS, TOKENS[3:9]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    _, model = hf_logits(dqdir, TOKENS)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(model, prompt, 12)
        assert_greedy_matches(model, prompt, out.outputs[0].token_ids, ref)


def test_online_mxfp4_dequantizes_to_the_formula(qwen3_dir):
    loaded = load_for_test(str(qwen3_dir), "mxfp4")
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    layer = loaded.model.model.layers[1]
    attn = hf.model.layers[1].self_attn
    w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    got = dequantize_mxfp4(layer.self_attn.qkv_proj.weight_blocks,
                           layer.self_attn.qkv_proj.weight_scales, torch.float32)
    blocks, scales, deq = ref_mxfp4(w)
    assert torch.equal(layer.self_attn.qkv_proj.weight_blocks, blocks)
    assert torch.equal(layer.self_attn.qkv_proj.weight_scales, scales)
    assert torch.equal(got, deq)


def test_online_mxfp4_logits_match_transformers_on_formula_dequantized(qwen3_dir, tmp_path):
    ref_dequantized_online(qwen3_dir, tmp_path / "dq", lambda w: ref_mxfp4(w)[2])
    ref, _ = hf_logits(tmp_path / "dq", TOKENS)
    packed = prefill_logits(load_for_test(str(qwen3_dir), "mxfp4"), TOKENS)
    dense = prefill_logits(load_for_test(str(qwen3_dir), "mxfp4", dequantize_at_load=True), TOKENS)
    assert (packed - ref).abs().max() < ATOL
    assert (dense - ref).abs().max() < ATOL


def test_packed_weights_take_0_53_bytes_per_param(qwen3_dir):
    loaded = load_for_test(str(qwen3_dir), "mxfp4")
    num_params = 0
    for module in loaded.model.modules():
        if getattr(module, "linear_format", None) is not None:
            assert module.linear_format.name == "mxfp4"
            assert "weight" not in module._parameters  # no dense copy kept
            assert module.weight_blocks.dtype == torch.uint8
            num_params += module.output_size * module.input_size
    sizes = quantized_weight_bytes(loaded.model)
    assert sizes == {"mxfp4": num_params * (0.5 + 1 / 32)}  # 0.53125 bytes/param
    dense = load_for_test(str(qwen3_dir), "mxfp4", dequantize_at_load=True)
    assert quantized_weight_bytes(dense.model) == {"mxfp4": num_params * 4}  # float32 model


def test_bf16_packed_and_dequantized_paths_agree(qwen3_dir):
    packed = prefill_logits(load_for_test(str(qwen3_dir), "mxfp4", dtype="bfloat16"), TOKENS)
    dense = prefill_logits(load_for_test(str(qwen3_dir), "mxfp4", dtype="bfloat16",
                                         dequantize_at_load=True), TOKENS)
    # Same bf16 weights either way; only the tiling of the matmul may differ.
    assert (packed - dense).abs().max() < 0.05 * packed.abs().max()


def test_llama_online_and_router_stays_dense(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama")
    ref_dequantized_online(path, tmp_path / "dq", lambda w: ref_mxfp4(w)[2])
    ref, _ = hf_logits(tmp_path / "dq", TOKENS)
    assert (prefill_logits(load_for_test(str(path), "mxfp4"), TOKENS) - ref).abs().max() < ATOL
    from inference_engine_quant.mx_linear import is_online_target

    assert is_online_target("model.layers.3.mlp.experts.down_proj")
    assert not is_online_target("model.layers.3.mlp.gate")
    assert not is_online_target("model.layers.3.mlp.router")
    assert not is_online_target("lm_head")


def test_missing_scale_and_wrong_shape_name_the_tensor(gpt_oss_style, tmp_path):
    from safetensors.torch import load_file, save_file

    qdir, _ = gpt_oss_style
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(qdir, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.0.mlp.down_proj.weight_scales"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scales"):
        load_for_test(str(broken))
    state = load_file(str(qdir / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight_blocks"
    state[name] = state[name][:, :1].contiguous()
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_blocks"):
        load_for_test(str(broken))
    state = load_file(str(qdir / "model.safetensors"))
    state[name] = state[name].to(torch.bfloat16)
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight_blocks: expected U8"):
        load_for_test(str(broken))


def test_forcing_mxfp4_on_another_quantized_checkpoint_is_refused():
    with pytest.raises(ValueError, match="already quantized with 'fp8'"):
        Mxfp4Method({"quant_method": "fp8"})
    with pytest.raises(ValueError, match="mx_scale_rule"):
        Mxfp4Method(None, mx_scale_rule="even")


class _FakeCuda(CpuPlatform):
    name = "cuda"
    device_type = "cuda"

    def supports_fp4(self) -> bool:
        return self._fp4

    def supports_triton(self) -> bool:
        return True

    def __init__(self, fp4: bool) -> None:
        super().__init__()
        self._fp4 = fp4


def test_kernel_for_follows_the_platform():
    assert "reference" in Mxfp4Method.kernel_for(CpuPlatform())
    assert "triton" in Mxfp4Method.kernel_for(_FakeCuda(False))
    assert "native FP4 GEMM not implemented" in Mxfp4Method.kernel_for(_FakeCuda(True))
