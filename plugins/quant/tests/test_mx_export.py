"""``quantize --method mxfp4|mxfp8|nvfp4`` writes real-format checkpoints the engine serves.

Tensor names, dtypes and config keys are checked against quant-formats.md
section 8; the written values against the spec-formula quantizers of
:mod:`inference_engine_quant.mx_testing`; and the engine, loading the output
with no flag, against transformers on those dequantized weights (1e-4).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from inference_engine.testing import make_tiny_model
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.mx_testing import (
    ref_mxfp4,
    ref_mxfp8,
    ref_nvfp4,
    write_quantized_checkpoint,
)
from inference_engine_quant.quantize_cli import quantize_checkpoint
from safetensors.torch import load_file

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("src"), "qwen3", intermediate_size=96)


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


def formula(method):
    def quantize(module, w):
        if method == "mxfp4":
            blocks, scales, deq = ref_mxfp4(w)
            return {".weight_blocks": blocks, ".weight_scales": scales}, deq
        if method == "mxfp8":
            q, scales, deq = ref_mxfp8(w)
            return {".weight": q, ".weight_scale": scales}, deq
        packed, b, g, deq = ref_nvfp4(w)
        return {".weight": packed, ".weight_scale": b, ".weight_scale_2": g}, deq
    return quantize


@pytest.mark.parametrize("method", ["mxfp4", "mxfp8", "nvfp4"])
def test_quantize_writes_the_format_and_the_engine_serves_it(method, src, tmp_path):
    out = tmp_path / "out"
    result = quantize_checkpoint(src, out, method, show_progress=False)
    assert result.quantized_tensors == 2 * 7
    # The same checkpoint written by the spec formulas, and its dequantized twin.
    write_quantized_checkpoint(src, tmp_path / "ref", tmp_path / "dq", formula(method))
    ours = load_file(str(out / "model.safetensors"))
    ref = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype, name
        if tensor.element_size() == 1:  # compare FP8/U8 tensors bytewise
            assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name
        else:
            assert torch.equal(ours[name], tensor), name
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    if method == "mxfp4":
        assert config["quant_method"] == "mxfp4"
        assert "lm_head" in config["modules_to_not_convert"]
        assert ours["model.layers.0.mlp.down_proj.weight_blocks"].shape == (64, 3, 16)
    else:
        assert config["quant_method"] == "modelopt"
        assert config["quant_algo"] == method.upper()
        hf_quant = json.loads((out / "hf_quant_config.json").read_text())
        assert hf_quant["quantization"]["quant_algo"] == method.upper()
    assert "lm_head.weight" in ours and ours["lm_head.weight"].dtype == torch.float32
    loaded = load_for_test(str(out))
    assert (prefill_logits(loaded, TOKENS) - hf_logits(tmp_path / "dq")).abs().max() < 1e-4
