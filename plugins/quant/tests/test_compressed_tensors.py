"""compressed-tensors checkpoints written by the compressed-tensors library, loaded by the engine.

:func:`~inference_engine_quant.ct_testing.write_ct_checkpoint` quantizes a tiny
random model with the library (its schemes, ``calculate_qparams``, its
compressors and ``quantization_config``). References:

* weight-only schemes (W4A16/W8A16 ``pack-quantized``): transformers on the
  library's dequantized weights (``fake_quantize``), to float32 rounding;
* schemes that quantize activations (FP8 dynamic, FP8 block, INT8 W8A8):
  transformers' own compressed-tensors loader on the checkpoint (it runs the
  library's quantized forward on CPU). A per-token activation quantizer can
  round one element differently on a last-bit input difference (one int8/FP8
  step), so all but one position must agree to 1e-4, and greedy tokens exactly.

transformers' loader is not used for asymmetric ``pack-quantized``
checkpoints: with compressed-tensors 0.20 it rejects the packed zero points'
shape (``[N/8, G]``, "size mismatch").
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits

ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from inference_engine_quant.ct_testing import write_ct_checkpoint  # noqa: E402

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]
SIZES = dict(hidden_size=256, intermediate_size=384, head_dim=64)


def _group_scheme(bits: int, group: int, symmetric: bool) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group))


WEIGHT_ONLY = {
    "W4A16": ("qwen3", "W4A16"),
    "W4A16_ASYM": ("qwen3", "W4A16_ASYM"),
    "W8A16": ("qwen3", "W8A16"),
    "int4_g32_asym": ("llama", _group_scheme(4, 32, False)),
    "int4_g64_sym": ("llama", _group_scheme(4, 64, True)),
    "int8_channel_asym": ("qwen3", QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="int", symmetric=False, strategy="channel"))),
}
WITH_ACTIVATIONS = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8"]


def _write(tmp_path, arch, scheme):
    src = make_tiny_model(tmp_path / "src", arch, **SIZES)
    write_ct_checkpoint(src, tmp_path / "q", tmp_path / "dq", scheme)
    return tmp_path / "q", tmp_path / "dq"


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


def hf_greedy(path, prompt, n):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def engine_greedy(path, prompt, n):
    llm = cpu_llm(path)  # quant_method auto-detected from config.json
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("case", list(WEIGHT_ONLY))
def test_weight_only_matches_dequantized_weights(tmp_path, case):
    arch, scheme = WEIGHT_ONLY[case]
    qdir, dqdir = _write(tmp_path, arch, scheme)
    loaded = load_for_test(str(qdir))
    layer = loaded.model.model.layers[0].mlp.gate_up_proj
    assert layer.int_kernel == "reference" and layer.qweight.dtype == torch.int32
    assert "weight_packed" not in dict(layer.named_parameters())
    ours = prefill_logits(loaded, TOKENS)
    ref = hf_logits(dqdir)
    assert torch.allclose(ours, ref, atol=2e-4, rtol=1e-4), (ours - ref).abs().max()


def _agree_but_one_position(ours, ref):
    per_position = (ours - ref).abs().amax(-1)
    assert int((per_position > 1e-4).sum()) <= 1, per_position
    assert float(per_position.max()) < 0.1, per_position


@pytest.mark.parametrize("preset", WITH_ACTIVATIONS)
def test_activation_schemes_match_transformers_loader(tmp_path, preset):
    qdir, _ = _write(tmp_path, "qwen3", preset)
    loaded = load_for_test(str(qdir))
    layer = loaded.model.model.layers[0].self_attn.qkv_proj
    if preset == "W8A8":
        assert layer.weight.dtype == torch.int8 and layer.int8_kernel == "int_mm"
    else:
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.fp8_act_quant
    _agree_but_one_position(prefill_logits(loaded, TOKENS), hf_logits(qdir))


def test_int_mm_and_reference_agree(tmp_path):
    qdir, _ = _write(tmp_path, "qwen3", "W8A8")
    layer = load_for_test(str(qdir)).model.model.layers[1].mlp.down_proj
    from inference_engine_quant.int8_w8a8 import apply_int8_w8a8

    x = torch.randn(5, layer.weight.shape[0])
    fast = apply_int8_w8a8(layer, x, None)
    layer.int8_kernel = "reference"
    slow = apply_int8_w8a8(layer, x, None)
    assert torch.allclose(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("case", "reference"), [("W4A16_ASYM", "dq"), ("FP8_DYNAMIC", "q"),
                                                 ("W8A8", "q")])
def test_greedy_generation(tmp_path, case, reference):
    arch, scheme = WEIGHT_ONLY.get(case, ("qwen3", case))
    qdir, dqdir = _write(tmp_path, arch, scheme)
    prompt = TOKENS[:6]
    assert engine_greedy(qdir, prompt, 12) == hf_greedy(dqdir if reference == "dq" else qdir,
                                                         prompt, 12)


def test_ignored_layers_stay_dense_and_flag_checks_format(tmp_path):
    src = make_tiny_model(tmp_path / "src", "qwen3", **SIZES)
    write_ct_checkpoint(src, tmp_path / "q", tmp_path / "dq", "W4A16",
                        ignore=["lm_head", "re:.*mlp.down_proj"])
    loaded = load_for_test(str(tmp_path / "q"), quantization="compressed-tensors")
    down = loaded.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float32 and not hasattr(down, "int_kernel")
    ours = prefill_logits(loaded, TOKENS)
    assert torch.allclose(ours, hf_logits(tmp_path / "dq"), atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs an AWQ checkpoint"):
        load_for_test(str(tmp_path / "q"), quantization="awq")


def test_unsupported_schemes_are_named():
    from inference_engine_quant.compressed_tensors_method import CompressedTensorsMethod

    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}}
    with pytest.raises(ValueError, match="group_0.*float4 tensor_group"):
        CompressedTensorsMethod(nvfp4)
    asym_act = {"quant_method": "compressed-tensors", "format": "int-quantized",
                "config_groups": {"g": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "int",
                                                    "strategy": "channel"},
                                        "input_activations": {"num_bits": 8, "type": "int",
                                                              "strategy": "token", "dynamic": True,
                                                              "symmetric": False}}}}
    with pytest.raises(ValueError, match="dynamic, symmetric, per token"):
        CompressedTensorsMethod(asym_act)
