"""FP8 MoE experts (DeepSeek-style block and per-tensor checkpoints, online PTPC) vs transformers.

A tiny random Qwen3-MoE is saved by transformers (one tensor per expert and
projection, as DeepSeek-V3 FP8 checkpoints store them); its expert weights
are quantized with the spec's formulas (``fp8_math``) into an ``fp8``
checkpoint, and transformers runs the dequantized twin. The engine keeps the
experts in FP8 (the torch path of the quantized fused MoE on the CPU) and its
logits must equal transformers' on the twin.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from inference_engine_quant.fp8_math import (
    quantize_weight_blockwise,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)
from inference_engine_quant.fp8_moe import Fp8FusedMoEMethod
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.mx_linear import quantized_weight_bytes
from safetensors.torch import load_file, save_file

TOKENS = [5, 17, 42, 99, 3, 120, 7, 64, 11, 2, 9]
E, H, I = 4, 64, 48  # noqa: E741 - experts, hidden, intermediate (not a multiple of the block)
BLOCK = 32


def _write(root, name, tensors, config_update):
    out = root / name
    out.mkdir()
    for f in (root / "src").iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if config_update:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config_update)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_moe")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=H, intermediate_size=64, moe_intermediate_size=I,
        num_experts=E, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(root / "src")
    state = load_file(str(root / "src" / "model.safetensors"))
    out = {}
    for scheme in ("block", "tensor"):
        quant, dequant = dict(state), dict(state)
        for name, w in state.items():
            if ".experts." not in name:
                continue
            if scheme == "block":
                q, s = quantize_weight_blockwise(w, (BLOCK, BLOCK))
                full = (s.repeat_interleave(BLOCK, 0)[: w.shape[0]]
                        .repeat_interleave(BLOCK, 1)[:, : w.shape[1]])
                quant[name.replace(".weight", ".weight_scale_inv")] = s
            else:
                q, s = quantize_weight_per_tensor(w)
                full = s
                quant[name.replace(".weight", ".weight_scale")] = s
            quant[name] = q
            dequant[name] = q.float() * full
        qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic",
                "ignored_layers": ["self_attn", "mlp.gate", "lm_head"]}
        if scheme == "block":
            qcfg["weight_block_size"] = [BLOCK, BLOCK]
        out[scheme] = (_write(root, f"q_{scheme}", quant, {"quantization_config": qcfg}),
                       _write(root, f"dq_{scheme}", dequant, None))
    out["src"] = root / "src"
    return out


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


@pytest.mark.parametrize(("scheme", "dequantize_at_load"),
                         [("block", False), ("tensor", False), ("block", True)])
def test_fp8_expert_checkpoint_matches_transformers(dirs, scheme, dequantize_at_load):
    qdir, dqdir = dirs[scheme]
    loaded = load_for_test(str(qdir), dequantize_at_load=dequantize_at_load)
    experts = loaded.model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, Fp8FusedMoEMethod)
    if not dequantize_at_load:
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
        # FP8 bytes plus one float32 scale per row and K block.
        k_blocks = (-(-H // BLOCK), -(-I // BLOCK)) if scheme == "block" else (1, 1)
        per_layer = E * (2 * I * H + H * I) + 4 * E * (2 * I * k_blocks[0] + H * k_blocks[1])
        assert quantized_weight_bytes(loaded.model)["fp8"] == per_layer
    ours = prefill_logits(loaded, TOKENS)
    torch.testing.assert_close(ours, hf_logits(dqdir), atol=1e-4, rtol=1e-4)


def test_online_fp8_quantizes_experts_per_row(dirs):
    """``--quantization ptpc_fp8`` on a float checkpoint: experts FP8 with a scale per row,
    equal to the per-channel formula; logits equal transformers on that dequantized twin."""
    src = dirs["src"]
    loaded = load_for_test(str(src), "ptpc_fp8")
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.down_proj.dtype == torch.float8_e4m3fn
    state = load_file(str(src / "model.safetensors"))
    w = state["model.layers.0.mlp.experts.2.down_proj.weight"]
    q, s = quantize_weight_per_channel(w)
    torch.testing.assert_close(experts.down_proj[2].float(), q.float())
    torch.testing.assert_close(experts.down_proj_scale[2], s)


@pytest.mark.parametrize("layout", ["NK", "KN"])
def test_quantize_cli_fp8_block_checkpoint_loads_experts_in_fp8(dirs, tmp_path, layout):
    """``inference-engine quantize --method fp8-block`` (either layout) writes per-expert FP8
    tensors with ``weight_scale_inv`` and leaves the router dense (named in the config's
    ignored layers); the experts load into FP8 equal to the block formula's."""
    from inference_engine_quant.quantize_cli import quantize_checkpoint

    out = tmp_path / "fp8_block"
    quantize_checkpoint(dirs["src"], out, "fp8-block", layout=layout, show_progress=False)
    loaded = load_for_test(str(out))
    experts = loaded.model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, Fp8FusedMoEMethod)
    state = load_file(str(dirs["src"] / "model.safetensors"))
    w = state["model.layers.0.mlp.experts.3.up_proj.weight"]  # [I, H], one 128x128 block
    q, s = quantize_weight_blockwise(w)
    torch.testing.assert_close(experts.gate_up_proj[3, I:].float(), q.float())
    torch.testing.assert_close(experts.gate_up_proj_scale[3, I:], s.expand(I, 1))
    assert torch.isfinite(prefill_logits(loaded, TOKENS)).all()
