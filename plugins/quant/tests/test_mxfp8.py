"""mxfp8 (E4M3 + E8M0 per 32): online and ModelOpt MXFP8 checkpoints against transformers.

Weight-only: same dequantized weights as the reference, so float32 logits
agree within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine.testing import make_tiny_model
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.mx_block import dequantize_mxfp8
from inference_engine_quant.mx_testing import (
    ref_dequantized_online,
    ref_mxfp8,
    write_quantized_checkpoint,
)
from inference_engine_quant.mxfp8 import mxfp8_linear_reference

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]
ATOL = 1e-4


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", intermediate_size=96)


def test_online_mxfp8_matches_transformers_on_formula_dequantized(qwen3_dir, tmp_path):
    ref_dequantized_online(qwen3_dir, tmp_path / "dq", lambda w: ref_mxfp8(w)[2])
    loaded = load_for_test(str(qwen3_dir), "mxfp8")
    down = loaded.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn
    assert down.weight.shape == (96, 64)  # the engine's (K, N) FP8 layout
    assert down.weight_scale.shape == (3, 64)
    ref = hf_logits(tmp_path / "dq", TOKENS)
    assert (prefill_logits(loaded, TOKENS) - ref).abs().max() < ATOL
    dense = load_for_test(str(qwen3_dir), "mxfp8", dequantize_at_load=True)
    assert (prefill_logits(dense, TOKENS) - ref).abs().max() < ATOL


def test_modelopt_mxfp8_checkpoint_loads(qwen3_dir, tmp_path):
    def quantize(module, w):
        q, scales, deq = ref_mxfp8(w)
        return {".weight": q, ".weight_scale": scales}, deq

    write_quantized_checkpoint(
        qwen3_dir, tmp_path / "q", tmp_path / "dq", quantize,
        quantization_config={"quant_method": "modelopt", "quant_algo": "MXFP8",
                             "ignore": ["lm_head"]})
    loaded = load_for_test(str(tmp_path / "q"))
    assert loaded.model.model.layers[1].self_attn.qkv_proj.linear_format.name == "mxfp8"
    ref = hf_logits(tmp_path / "dq", TOKENS)
    assert (prefill_logits(loaded, TOKENS) - ref).abs().max() < ATOL


def test_k_tiled_reference_equals_one_shot_dequant(monkeypatch):
    import inference_engine_quant.mxfp8 as mxfp8

    torch.manual_seed(0)
    w = torch.randn(24, 200)
    q, scales, deq = ref_mxfp8(torch.nn.functional.pad(w, (0, 24)))
    x = torch.randn(3, 200)
    monkeypatch.setattr(mxfp8, "_TILE_ELEMENTS", 32 * 24)  # one 32-row block per tile
    got = mxfp8_linear_reference(x, q.t().contiguous(), scales.t().contiguous(), 200)
    assert torch.allclose(got, x @ deq[:, :200].T, atol=1e-5)
    assert torch.equal(dequantize_mxfp8(q, scales), deq)
