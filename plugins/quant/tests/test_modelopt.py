"""ModelOpt MIXED_PRECISION: NVFP4, FP8 and unquantized layers in one checkpoint.

The checkpoint is written with the spec's formulas: layer 0's attention is
NVFP4, its MLP FP8 per-tensor (static ``input_scale``), layer 1 is not in
``quantized_layers`` (left unquantized) and ``lm_head`` is excluded. The
reference is transformers on the dequantized weights with the FP8 layers'
inputs quantize-dequantized by the spec formula (``e4m3(clamp(x/s, ±448)) * s``)
in forward pre-hooks. An FP8 activation rounding boundary can flip on a
last-bit input difference (one E4M3 step is 1/16 relative), so logits are
held to 1e-3 overall and 1e-4 at most positions.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine.testing import make_tiny_model
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.modelopt import ModelOptMethod
from inference_engine_quant.mx_linear import quantized_weight_bytes
from inference_engine_quant.mx_testing import (
    fake_quant_inputs,
    ref_fp8_per_tensor,
    ref_nvfp4,
    write_quantized_checkpoint,
)

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def fp8_qdq(x, s):
    return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt_mixed")
    src = make_tiny_model(root / "src", "qwen3", intermediate_size=96)
    model = hf_model(src)
    amax = {}
    handles = [m.register_forward_pre_hook(
        lambda _m, args, n=n: amax.__setitem__(n, float(args[0].abs().max())))
        for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.tensor([TOKENS]))
    for h in handles:
        h.remove()
    layers = {}
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        layers[f"model.layers.0.self_attn.{p}"] = {"quant_algo": "NVFP4", "group_size": 16}
    for p in ("gate_proj", "up_proj", "down_proj"):
        layers[f"model.layers.0.mlp.{p}"] = {"quant_algo": "FP8"}

    def quantize(module, w):
        algo = layers.get(module, {}).get("quant_algo")
        if algo == "NVFP4":
            packed, b, g, deq = ref_nvfp4(w)
            return {".weight": packed, ".weight_scale": b, ".weight_scale_2": g}, deq
        if algo == "FP8":
            q, s, deq = ref_fp8_per_tensor(w)
            return {".weight": q, ".weight_scale": s,
                    ".input_scale": torch.tensor(amax[module] / 448)}, deq
        return None

    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                 "exclude_modules": ["lm_head"], "quantized_layers": layers}}
    write_quantized_checkpoint(src, root / "q", root / "dq", quantize, hf_quant_config=hf_quant)
    return root / "q", root / "dq", amax, layers


def test_three_kinds_of_layers_dispatch_per_prefix(mixed):
    qdir, _, _, _ = mixed
    loaded = load_for_test(str(qdir))
    l0, l1 = loaded.model.model.layers[0], loaded.model.model.layers[1]
    assert isinstance(l0.mlp.down_proj.quant_method, ModelOptMethod)
    assert l0.self_attn.qkv_proj.linear_format.name == "nvfp4"
    assert l0.self_attn.o_proj.linear_format.name == "nvfp4"
    assert l0.mlp.gate_up_proj.linear_format.name == "fp8"
    assert l0.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert l1.mlp.gate_up_proj.linear_format.name == "dense"
    assert l1.self_attn.qkv_proj.weight.dtype == torch.float32
    sizes = quantized_weight_bytes(loaded.model)
    assert set(sizes) == {"nvfp4", "fp8", "dense"}


def test_mixed_logits_match_transformers_with_fp8_input_quantization(mixed):
    qdir, dqdir, amax, layers = mixed
    model = hf_model(dqdir)

    def qdq_for(name):
        if layers.get(name, {}).get("quant_algo") != "FP8":
            return None
        # gate/up see the same input, so their calibrated scales (merged by max) are equal.
        s = amax[name] / 448
        return lambda x, s=s: fp8_qdq(x, s)

    fake_quant_inputs(model, qdq_for)
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0].float()
    ours = prefill_logits(load_for_test(str(qdir)), TOKENS)
    diff = (ours - ref).abs()
    assert diff.max() < 1e-3
    assert (diff.amax(dim=1) < 1e-4).float().mean() >= 0.75


def test_fused_parts_in_different_formats_are_refused():
    cfg = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.self_attn.q_proj": {"quant_algo": "NVFP4", "group_size": 16},
        "model.layers.0.self_attn.k_proj": {"quant_algo": "FP8"}}}
    method = ModelOptMethod(cfg)
    with pytest.raises(ValueError, match="q_proj: NVFP4.*k_proj: FP8.*v_proj: unquantized"):
        method.algo_for("model.layers.0.self_attn.qkv_proj")
    assert method.algo_for("model.layers.0.mlp.down_proj") is None


def test_unsupported_algorithms_and_group_sizes_are_named():
    with pytest.raises(ValueError, match="'W4A8_AWQ' is not supported"):
        ModelOptMethod({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"})
    with pytest.raises(ValueError, match="NVFP4 needs group_size 16, got 32"):
        ModelOptMethod({"quantization": {"quant_algo": "NVFP4", "group_size": 32}})
    with pytest.raises(ValueError, match="no quantized_layers"):
        ModelOptMethod({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"})


def test_exclude_patterns_match_modules_not_substrings():
    method = ModelOptMethod({"quant_method": "modelopt", "quant_algo": "NVFP4",
                             "exclude_modules": ["model.layers.0.mlp.gate", "*self_attn*"]})
    assert method.algo_for("model.layers.0.mlp.gate_up_proj") == "NVFP4"
    assert method.algo_for("model.layers.0.mlp.gate") is None
    assert method.algo_for("model.layers.1.self_attn.qkv_proj") is None
