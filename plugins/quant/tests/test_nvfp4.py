"""nvfp4 end to end: ModelOpt NVFP4 checkpoints and online W4A16 against transformers.

Checkpoints are written with the spec's formulas (:mod:`inference_engine_quant.mx_testing`).
Weight-only (no ``input_scale``): same dequantized weights, so float32 logits
agree within 1e-4. With a calibrated ``input_scale`` (W4A4) the reference
transformers model quantize-dequantizes each linear input with the spec's
activation formula in forward pre-hooks; a last-bit difference in an input can
move one element across an E2M1 rounding boundary, so that case is held to
1e-3 (one FP4 step of one activation element times a 0.08-scale weight is
below that on this model) and the bulk of positions to 1e-4.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.mx_linear import quantized_weight_bytes
from inference_engine_quant.mx_testing import (
    fake_quant_inputs,
    ref_dequantized_online,
    ref_nvfp4,
    ref_nvfp4_qdq_activation,
    write_quantized_checkpoint,
)
from inference_engine_quant.nvfp4_method import Nvfp4Method
from safetensors.torch import load_file, save_file

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]
ATOL = 1e-4


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", intermediate_size=96)


def _input_amax(src):
    """Calibrated amax of each linear layer's input on TOKENS (as ModelOpt calibrates)."""
    model = hf_model(src)
    amax = {}

    def hook(name):
        def fn(_m, args):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    hf_logits(model, TOKENS)
    for h in handles:
        h.remove()
    return amax


def build_modelopt_nvfp4(src, root, with_input_scale):
    amax = _input_amax(src) if with_input_scale else {}

    def quantize(module, w):
        packed, b, g, deq = ref_nvfp4(w)
        tensors = {".weight": packed, ".weight_scale": b, ".weight_scale_2": g}
        if with_input_scale:
            tensors[".input_scale"] = torch.tensor(amax[module] / (6 * 448))
        return tensors, deq

    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                 "group_size": 16, "exclude_modules": ["lm_head"]}}
    if with_input_scale:  # the newer export: config.json quantization_config only
        write_quantized_checkpoint(src, root / "q", root / "dq", quantize,
                                   quantization_config={"quant_method": "modelopt",
                                                        **hf_quant["quantization"]})
    else:
        write_quantized_checkpoint(src, root / "q", root / "dq", quantize, hf_quant_config=hf_quant)
    return root / "q", root / "dq", amax


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory, qwen3_dir):
    return build_modelopt_nvfp4(qwen3_dir, tmp_path_factory.mktemp("nvfp4"), False)


@pytest.fixture(scope="module")
def w4a4(tmp_path_factory, qwen3_dir):
    return build_modelopt_nvfp4(qwen3_dir, tmp_path_factory.mktemp("nvfp4a"), True)


def test_hf_quant_config_checkpoint_matches_transformers(w4a16):
    qdir, dqdir, _ = w4a16
    loaded = load_for_test(str(qdir))  # detected from hf_quant_config.json, no flag
    layer = loaded.model.model.layers[0].self_attn.qkv_proj
    assert layer.linear_format.name == "nvfp4"
    assert layer.input_scale is None  # weight-only: no input_scale in the checkpoint
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale.dtype == torch.float8_e4m3fn
    ours = prefill_logits(loaded, TOKENS)
    ref = hf_logits(hf_model(dqdir), TOKENS)
    assert (ours - ref).abs().max() < ATOL
    dense = prefill_logits(load_for_test(str(qdir), dequantize_at_load=True), TOKENS)
    assert (dense - ref).abs().max() < ATOL


def test_fused_parts_keep_their_own_global_scales(w4a16):
    qdir, _, _ = w4a16
    state = load_file(str(qdir / "model.safetensors"))
    layer = load_for_test(str(qdir)).model.model.layers[1].self_attn.qkv_proj
    expected = torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight_scale_2"].expand(n)
                          for p, n in zip("qkv", layer.output_sizes, strict=True)])
    assert torch.equal(layer.weight_global, expected)


def test_input_scale_checkpoint_quantizes_activations_like_the_spec(w4a4):
    qdir, dqdir, amax = w4a4
    loaded = load_for_test(str(qdir))
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.input_scale is not None
    model = hf_model(dqdir)
    # Fused parts share one input: their (here equal) input scales merge by max.
    fake_quant_inputs(model, lambda name: None if name == "lm_head" else (
        lambda x, s=amax[name] / (6 * 448): ref_nvfp4_qdq_activation(x, s)))
    ref = hf_logits(model, TOKENS)
    ours = prefill_logits(loaded, TOKENS)
    diff = (ours - ref).abs()
    assert diff.max() < 1e-3
    assert (diff.amax(dim=1) < ATOL).float().mean() >= 0.75
    # The activation quantization is really applied: the weight-only result differs.
    plain = hf_logits(hf_model(dqdir), TOKENS)
    assert (ours - plain).abs().max() > 10 * ATOL


def test_online_nvfp4_is_weight_only_and_matches_the_formula(qwen3_dir, tmp_path):
    # One global scale per (fused) layer, computed on the fused weight.
    ref_dequantized_online(qwen3_dir, tmp_path / "dq", lambda w: ref_nvfp4(w)[3], fuse=True)
    loaded = load_for_test(str(qwen3_dir), "nvfp4")
    assert loaded.model.model.layers[0].mlp.down_proj.input_scale is None
    ours = prefill_logits(loaded, TOKENS)
    ref = hf_logits(hf_model(tmp_path / "dq"), TOKENS)
    assert (ours - ref).abs().max() < ATOL
    num_params = sum(m.output_size * m.input_size for m in loaded.model.modules()
                     if getattr(m, "linear_format", None) is not None)
    # 0.5 byte/value + 1 byte per 16 + a float32 global per row.
    rows = sum(m.output_size for m in loaded.model.modules()
               if getattr(m, "linear_format", None) is not None)
    assert quantized_weight_bytes(loaded.model) == {"nvfp4": num_params * (0.5 + 1 / 16) + 4 * rows}


def test_online_nvfp4_greedy_through_the_engine(qwen3_dir, tmp_path):
    ref_dequantized_online(qwen3_dir, tmp_path / "dq", lambda w: ref_nvfp4(w)[3], fuse=True)
    model = hf_model(tmp_path / "dq")
    model.generation_config.eos_token_id = None
    llm = cpu_llm(str(qwen3_dir), dtype="float32", quantization="nvfp4", show_progress=False,
              kv_cache_memory=1 << 22, block_size=4)
    out = llm.generate([TOKENS], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    with torch.no_grad():
        ref = model.generate(torch.tensor([TOKENS]), do_sample=False, max_new_tokens=10,
                             attention_mask=torch.ones(1, len(TOKENS), dtype=torch.long))
    ref = ref[0, len(TOKENS):].tolist()
    ours = out[0].outputs[0].token_ids
    for pos, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            logits = hf_logits(model, TOKENS + ref[:pos])[-1]
            top2 = logits.topk(2)
            assert float(top2.values[0] - top2.values[1]) < 1e-4, f"token {pos} differs"
            break


def test_missing_global_scale_and_bad_dtype_name_the_tensor(w4a16, tmp_path):
    qdir, _, _ = w4a16
    broken = tmp_path / "broken"
    shutil.copytree(qdir, broken)
    state = load_file(str(qdir / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight_scale_2"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight_scale_2"):
        load_for_test(str(broken))
    state = load_file(str(qdir / "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj.weight_scale"
    state[name] = state[name].float()
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"gate_proj\.weight_scale: .*expected F8_E4M3"):
        load_for_test(str(broken))


def test_forcing_nvfp4_on_another_quantized_checkpoint_is_refused():
    with pytest.raises(ValueError, match="already quantized with 'mxfp4'"):
        Nvfp4Method({"quant_method": "mxfp4"})


def test_forcing_nvfp4_on_a_modelopt_checkpoint_of_another_algo_is_refused():
    with pytest.raises(ValueError, match="cannot run a ModelOpt FP8 checkpoint"):
        Nvfp4Method({"quant_method": "modelopt", "quant_algo": "FP8"})
    method = Nvfp4Method({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}})
    assert method.format_for("model.layers.0.mlp.down_proj", [64]).name == "nvfp4"
