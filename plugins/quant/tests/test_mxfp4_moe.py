"""gpt-oss MXFP4 experts (``*_blocks`` / ``*_scales``) through the fused-MoE layer.

A tiny random transformers gpt-oss is written in gpt-oss's MXFP4 layout with
the spec formulas (rows of ``gate_up_proj_blocks`` interleaved gate/up, as
transformers' ``Mxfp4GptOssExperts`` reads them); transformers runs the same
dequantized experts. Float32 logits within 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from inference_engine.testing import train_tiny_tokenizer
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.mx_linear import quantized_weight_bytes
from inference_engine_quant.mx_testing import ref_mxfp4
from inference_engine_quant.mxfp4_moe import Mxfp4FusedMoEMethod
from safetensors.torch import load_file, save_file

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2, 9]
E, H, I = 4, 64, 32  # noqa: E741 - experts, hidden, intermediate


def _mxfp4_experts(w_rows: torch.Tensor):
    """``[E, rows, K]`` -> (blocks [E, rows, K/32, 16], scales [E, rows, K/32], dequant)."""
    e, rows, k = w_rows.shape
    blocks, scales, deq = ref_mxfp4(w_rows.reshape(e * rows, k))
    return (blocks.reshape(e, rows, k // 32, 16), scales.reshape(e, rows, k // 32),
            deq.reshape(e, rows, k))


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    tokenizer = train_tiny_tokenizer()
    config = transformers.GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=H, intermediate_size=I, head_dim=16,
        num_local_experts=E, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=5,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(root / "src")
    tokenizer.save_pretrained(root / "src")
    state = load_file(str(root / "src" / "model.safetensors"))
    quant, dequant = dict(state), dict(state)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = state[f"{p}.gate_up_proj"]  # [E, H, 2I], gate/up columns interleaved
        down = state[f"{p}.down_proj"]  # [E, I, H]
        blocks, scales, deq = _mxfp4_experts(gate_up.transpose(1, 2))  # rows stay interleaved
        quant[f"{p}.gate_up_proj_blocks"], quant[f"{p}.gate_up_proj_scales"] = blocks, scales
        dequant[f"{p}.gate_up_proj"] = deq.transpose(1, 2).contiguous()
        blocks, scales, deq = _mxfp4_experts(down.transpose(1, 2))
        quant[f"{p}.down_proj_blocks"], quant[f"{p}.down_proj_scales"] = blocks, scales
        dequant[f"{p}.down_proj"] = deq.transpose(1, 2).contiguous()
        del quant[f"{p}.gate_up_proj"], quant[f"{p}.down_proj"]
    return _write_twins(root, quant, dequant, [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])


def _write_twins(root, quant, dequant, not_converted):
    """``root/q`` (the MXFP4 checkpoint) and ``root/dq`` (its dequantized twin), each a copy
    of ``root/src`` with its own tensors; returns both paths."""
    for name, tensors in (("q", quant), ("dq", dequant)):
        out = root / name
        out.mkdir()
        for f in (root / "src").iterdir():
            if f.suffix != ".safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    cfg_path = root / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": not_converted}
    cfg_path.write_text(json.dumps(cfg))
    return root / "q", root / "dq"


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


@pytest.mark.parametrize("dequantize_at_load", [False, True])
def test_gpt_oss_mxfp4_experts_match_transformers(gpt_oss_dirs, dequantize_at_load):
    qdir, dqdir = gpt_oss_dirs
    loaded = load_for_test(str(qdir), dequantize_at_load=dequantize_at_load)
    experts = loaded.model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, Mxfp4FusedMoEMethod)
    if not dequantize_at_load:
        assert experts.gate_up_proj_blocks.dtype == torch.uint8
        sizes = quantized_weight_bytes(loaded.model)
        per_layer = E * (2 * I * H + H * I) * (0.5 + 1 / 32)
        assert sizes["mxfp4"] == 2 * per_layer
        assert "gate_up_proj" not in experts._parameters
    ours = prefill_logits(loaded, TOKENS)
    assert (ours - hf_logits(dqdir)).abs().max() < 1e-4


def test_online_mxfp4_quantizes_experts(gpt_oss_dirs, tmp_path):
    qdir, _ = gpt_oss_dirs
    src = qdir.parent / "src"
    loaded = load_for_test(str(src), "mxfp4")
    experts = loaded.model.model.layers[1].mlp.experts
    assert experts.down_proj_blocks.dtype == torch.uint8
    # Online blocks of the engine's (de-interleaved) layout equal the formula's.
    state = load_file(str(src / "model.safetensors"))
    down = state["model.layers.1.mlp.experts.down_proj"].transpose(1, 2)
    blocks, scales, _ = _mxfp4_experts(down)
    assert torch.equal(experts.down_proj_blocks, blocks)
    assert torch.equal(experts.down_proj_scales, scales)


# ---- MiniMax-M3: MXFP4 experts in the gate-then-up row layout ---------------------------
M3_PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 30, 2, 9, 77, 41, 8, 120, 33]


@pytest.fixture(scope="module")
def m3_dirs(tmp_path_factory):
    """A tiny MiniMax-M3 text model whose routed experts are MXFP4 (``*_blocks`` /
    ``*_scales``, rows gate then up as its experts split them) and its twin holding the
    same experts dequantized by the spec formula, for transformers."""
    root = tmp_path_factory.mktemp("minimax_m3")
    tokenizer = train_tiny_tokenizer()
    config = transformers.MiniMaxM3VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=H, intermediate_size=I,
        dense_intermediate_size=96, shared_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=E,
        num_experts_per_tok=2, max_position_embeddings=256, routed_scaling_factor=2.0,
        layer_types=["full_attention", "minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], index_n_heads=2, index_head_dim=16,
        index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(root / "src")
    tokenizer.save_pretrained(root / "src")
    state = load_file(str(root / "src" / "model.safetensors"))
    quant, dequant = dict(state), dict(state)
    experts = [k[: -len(".gate_up_proj")] for k in state if k.endswith("experts.gate_up_proj")]
    assert len(experts) == 2
    for p in experts:
        for part in ("gate_up_proj", "down_proj"):  # [E, out, in]: rows are output features
            blocks, scales, deq = _mxfp4_experts(state[f"{p}.{part}"])
            quant[f"{p}.{part}_blocks"], quant[f"{p}.{part}_scales"] = blocks, scales
            dequant[f"{p}.{part}"] = deq.contiguous()
            del quant[f"{p}.{part}"]
    return _write_twins(root, quant, dequant, [
        "model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts",
        "model.layers.0.mlp", "model.embed_tokens", "lm_head"])


def test_minimax_m3_mxfp4_experts_match_transformers(m3_dirs):
    """Greedy tokens and each chosen token's log-probability against transformers running
    the dequantized experts (float32), through the engine with the experts kept packed."""
    from inference_engine import SamplingParams
    from inference_engine.testing import cpu_llm

    qdir, dqdir = m3_dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(dqdir, dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    new = 12
    with torch.no_grad():
        out = hf.generate(torch.tensor([M3_PROMPT]), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[0, len(M3_PROMPT):].tolist()
    want_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, want,
                                                                                strict=True)]
    llm = cpu_llm(qdir, dtype="float32", async_scheduling=False, kv_cache_memory=8 << 20)
    experts = llm.engine.model.model.layers[1].mlp.experts
    assert isinstance(experts.quant_method, Mxfp4FusedMoEMethod)
    assert experts.gate_up_proj_blocks.dtype == torch.uint8
    (got,) = llm.generate({"prompt_token_ids": M3_PROMPT}, SamplingParams(
        temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0))
    assert list(got.outputs[0].token_ids) == want
    got_lp = [step[t].logprob for step, t in zip(got.outputs[0].logprobs, want, strict=True)]
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) < 1e-4
