"""``inference-engine quantize``: written checkpoints follow the formats and load back.

References: the spec formulas (quant-formats.md sections 3 and 4) written out
here for the tensors on disk, and the engine's online quantization of the
same plain checkpoint for the tokens (same scheme, so identical logits).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from inference_engine.sampling_params import SamplingParams
from inference_engine.testing import cpu_llm, make_tiny_model, run_cli
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.quantize_cli import quantize_checkpoint, run_quantize_command
from inference_engine_quant.quantize_exporters import (
    QuantExporter,
    get_exporter,
    register_exporter,
)
from safetensors.torch import load_file

FP8 = torch.float8_e4m3fn
PROMPT = [9, 31, 4, 77, 150, 2, 66, 23]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # Sizes multiples of 128: transformers' CPU FineGrainedFP8 dequantization needs whole
    # tiles (partial edge tiles are covered in test_fp8_checkpoint.py).
    return make_tiny_model(tmp_path_factory.mktemp("qbase"), "qwen3", hidden_size=256,
                           intermediate_size=384, head_dim=32)


def test_cli_writes_fp8_checkpoint(base, tmp_path):
    out = tmp_path / "fp8"
    result = run_cli("quantize", str(base), "--method", "fp8", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "weights quantized" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_layout": "KN",
        "ignored_layers": ["re:.*\\.mlp\\.(gate|router)$"]}  # MoE routers stay dense
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).exists(), name
    source = load_file(str(base / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    w = source["model.layers.0.self_attn.q_proj.weight"]
    s = w.abs().max() / 448
    q = (w / s).clamp(-448, 448).to(FP8)
    assert written["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert torch.equal(written["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8),
                       q.t().contiguous().view(torch.uint8))  # (K, N) on disk
    assert written["model.layers.0.self_attn.q_proj.weight_scale"].item() == pytest.approx(s.item())
    assert torch.equal(written["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    assert torch.equal(written["lm_head.weight"], source["lm_head.weight"])
    assert "model.layers.0.input_layernorm.weight_scale" not in written


def test_round_trip_matches_online_quantization(base, tmp_path):
    quantize_checkpoint(base, tmp_path / "fp8", "fp8", show_progress=False)
    offline = prefill_logits(load_for_test(str(tmp_path / "fp8")), PROMPT)
    online = prefill_logits(load_for_test(str(base), quantization="fp8"), PROMPT)
    assert torch.equal(offline, online)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", show_progress=False, kv_cache_memory=1 << 22)
    a = cpu_llm(str(tmp_path / "fp8"), **kw).generate([PROMPT], params)[0].outputs[0].token_ids
    b = cpu_llm(str(base), quantization="fp8", **kw).generate([PROMPT], params)[0]
    b = b.outputs[0].token_ids
    assert a == b and len(a) == 10


def _spec_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    s = torch.empty(math.ceil(n / 128), math.ceil(k / 128))
    q = torch.empty(n, k, dtype=FP8)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = tile.abs().max() / 448
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile / s[i, j]).clamp(
                -448, 448).to(FP8)
    return q, s


@pytest.mark.parametrize("layout", ["KN", "NK"])
def test_block_tensors_follow_the_spec(base, tmp_path, layout):
    out = tmp_path / layout
    quantize_checkpoint(base, out, "fp8-block", layout=layout, show_progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [128, 128] and qc["weight_layout"] == layout
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3"
    w = load_file(str(base / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    q, s = _spec_block(w)  # [256, 384] -> scales [2, 3]
    written = load_file(str(out / "model.safetensors"))
    got_q = written["model.layers.1.mlp.down_proj.weight"]
    got_s = written["model.layers.1.mlp.down_proj.weight_scale_inv"]
    if layout == "KN":
        got_q, got_s = got_q.t(), got_s.t()
    assert got_s.shape == (2, 3) and got_s.dtype == torch.float32
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.allclose(got_s, s, rtol=0, atol=0)


def test_both_layouts_load_to_the_same_logits(base, tmp_path):
    quantize_checkpoint(base, tmp_path / "kn", "fp8-block", show_progress=False)
    quantize_checkpoint(base, tmp_path / "nk", "fp8-block", layout="NK", show_progress=False)
    kn = prefill_logits(load_for_test(str(tmp_path / "kn")), PROMPT)
    nk = prefill_logits(load_for_test(str(tmp_path / "nk")), PROMPT)
    assert torch.equal(kn, nk)


def test_nk_block_checkpoint_loads_in_transformers(base, tmp_path):
    """HF FineGrainedFP8 dequantizes on CPU (needs accelerate); compare with our dequantization."""
    pytest.importorskip("accelerate")
    import transformers
    from inference_engine_quant.fp8_math import dequantize_weight_kn

    quantize_checkpoint(base, tmp_path / "nk", "fp8-block", layout="NK", show_progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "nk", dtype=torch.float32)
    written = load_file(str(tmp_path / "nk" / "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj"
    ours = dequantize_weight_kn(written[f"{name}.weight"].t(),
                                written[f"{name}.weight_scale_inv"].t(), (128, 128)).t()
    theirs = dict(hf.named_parameters())[f"{name}.weight"].float()
    assert torch.allclose(theirs, ours, rtol=1e-2, atol=1e-6)  # transformers rounds to bf16


def test_errors_are_clear(base, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown --method 'int3'"):
        quantize_checkpoint(base, tmp_path / "x", "int3", show_progress=False)
    with pytest.raises(ValueError, match="--layout 'XY'"):
        quantize_checkpoint(base, tmp_path / "x", "fp8", layout="XY", show_progress=False)
    quantize_checkpoint(base, tmp_path / "done", "fp8", show_progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(tmp_path / "done", tmp_path / "again", "fp8", show_progress=False)
    with pytest.raises(ValueError, match="not empty"):
        quantize_checkpoint(base, tmp_path / "done", "fp8", show_progress=False)
    with pytest.raises(ValueError, match="no config.json"):
        quantize_checkpoint(tmp_path, tmp_path / "y", "fp8", show_progress=False)
    assert run_quantize_command(str(base), "int3", str(tmp_path / "z"), None, False) == 2
    assert "unknown --method 'int3'" in capsys.readouterr().err


def test_exporter_registry_extension_point(base, tmp_path):
    """A method plugs in an exporter by name; the CLI writes what it returns."""
    def halve(module: str, w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
        return {"weight": (w / 2).to(torch.bfloat16)}

    register_exporter(QuantExporter("test-halve", halve, lambda layout: {"quant_method": "x"},
                                    layouts=("NK",)))
    assert get_exporter("test-halve").name == "test-halve"
    quantize_checkpoint(base, tmp_path / "h", "test-halve", show_progress=False)
    written = load_file(str(tmp_path / "h" / "model.safetensors"))
    source = load_file(str(base / "model.safetensors"))
    key = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(written[key], (source[key] / 2).to(torch.bfloat16))
    assert json.loads(Path(tmp_path / "h" / "config.json").read_text())[
        "quantization_config"] == {"quant_method": "x"}
