"""Greedy tokens through the engine from a GGUF file equal transformers on the same weights.

The reference is the transformers model holding exactly the values the file
stores, dequantized by the ``gguf`` package's numpy code. Where a token
differs it must be a genuine near-tie of the reference (top-2 within 1e-4).

That comparison runs the engine with ``activations=float``. The default
``activations=q8`` (llama.cpp's arithmetic) is checked layer by layer inside a
whole generate against ggml's Q8_K / Q8_0 / Q8_1 rounding and dot products in numpy.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from inference_engine import SamplingParams
from inference_engine.testing import cpu_llm
from inference_engine.testing_parity import assert_greedy_matches, hf_greedy
from inference_engine_gguf import q8k_kernels
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.export import export_to_gguf
from inference_engine_gguf.q8k_kernels import unpack_tiles
from inference_engine_gguf.quant_method import GGMLLMHead, raw_rows
from inference_engine_gguf.testing import block32_matmul_reference, q8k_matmul_reference

NEW_TOKENS = 10
PROMPTS = ["The quick brown fox", "héllo wörld, naïve café"]
SMALL_KV = 1 << 22


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    """Roughly llama.cpp's Q4_K_M mix: Q6_K for v, down and the output head."""
    return T.Q6_K if any(k in name for k in ("v_proj", "down_proj", "lm_head")) else T.Q4_K


def mixed(table: dict[str, T], default: T = T.F16):
    """Types by name fragment (first match wins), so one small model covers many types;
    q/k/v and gate/up of one layer differ, exercising fused layers of several segments."""

    def choose(name: str, shape: tuple[int, ...]) -> T:
        return next((t for frag, t in table.items() if frag in name), default)

    return choose


MIX_A = mixed({
    "layers.0.self_attn.q_proj": T.Q8_0, "layers.0.self_attn.k_proj": T.Q4_0,
    "layers.0.self_attn.v_proj": T.Q5_1, "layers.0.self_attn.o_proj": T.Q2_K,
    "layers.0.mlp.gate_proj": T.Q3_K, "layers.0.mlp.up_proj": T.Q5_K,
    "layers.0.mlp.down_proj": T.MXFP4, "layers.1.self_attn": T.BF16,
    "layers.1.mlp": T.Q6_K, "embed_tokens": T.Q5_K, "lm_head": T.BF16,
})
MIX_B = mixed({"self_attn.q_proj": T.Q4_1, "self_attn.k_proj": T.Q5_0, "mlp": T.Q8_0,
               "embed_tokens": T.Q4_0})
# Tiled (Q4_K, Q5_K, Q6_K) parts beside other K-quants and legacy types in one fused layer.
MIX_C = mixed({"self_attn.q_proj": T.Q4_K, "self_attn.k_proj": T.Q8_0,
               "self_attn.v_proj": T.Q6_K, "self_attn.o_proj": T.Q5_K, "mlp.gate_proj": T.Q6_K,
               "mlp.up_proj": T.Q5_0, "mlp.down_proj": T.Q4_K, "lm_head": T.Q4_K})

CASES = {
    "qwen3-F16": ("qwen3", T.F16, {}),
    "qwen3-Q4_K_M": ("qwen3", q4_k_m, {}),
    "qwen3-mixed": ("qwen3", MIX_A, {}),
    "qwen3-mixed-tiles": ("qwen3", MIX_C, {}),
    "qwen3-Q4_K-tied": ("qwen3", T.Q4_K, {"tie_word_embeddings": True}),
    "llama-Q4_K_M": ("llama", q4_k_m, {}),
    "llama-mixed": ("llama", MIX_B, {"rope_theta": 50000.0}),
    "llama-rope-llama3": ("llama", T.Q8_0, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2-Q8_0": ("qwen2", T.Q8_0, {}),
    "qwen3moe-Q4_K_M": ("qwen3_moe", q4_k_m, {}),
}


def reference_continuations(model, stored, prompt_ids):
    model.load_state_dict({**model.state_dict(), **stored})
    model.generation_config.eos_token_id = None
    return hf_greedy(model, prompt_ids, NEW_TOKENS)


K_QUANTS = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
def run_engine(path, prompt_ids, **kwargs):
    llm = cpu_llm(str(path), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV,
                  **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(case, tmp_path, tokenizer, make_hf_model):
    arch, qtype, overrides = CASES[case]
    model = make_hf_model(arch, seed=len(case), **overrides)
    path = tmp_path / "model.gguf"
    stored = export_to_gguf(model, tokenizer, path, qtype)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    ref = reference_continuations(model, stored, prompt_ids)
    llm, ours = run_engine(path, prompt_ids, quant_options={"activations": "float"})
    assert llm.get_tokenizer()("The quick brown fox")["input_ids"] == prompt_ids[0]
    # The layers really hold the file's blocks, not dense copies.
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.gguf_segments is not None and qkv.weight.numel() == 0
    for ids, a, b in zip(prompt_ids, ours, ref, strict=True):
        assert_greedy_matches(model, ids, a, b)


Q8_CASES = ["qwen3-Q4_K_M", "qwen3-mixed", "qwen3-mixed-tiles", "qwen3-Q4_K-tied", "llama-Q4_K_M",
            "qwen3moe-Q4_K_M", "qwen2-Q8_0", "llama-mixed"]


@pytest.mark.parametrize("case", Q8_CASES)
def test_q8_layers_compute_llamacpp_arithmetic_in_the_engine(case, tmp_path, tokenizer,
                                                            make_hf_model):
    """The default ``activations=q8``, through a whole generate: every block-type layer's output
    (fused parts, packed tiles and the LM head included) equals ggml's Q8_K rounding of the
    very input it got times the file's weights (Q8_0 / Q8_1 for the 32-value block types),
    and not the float product.

    Greedy tokens are not compared here: an input within float rounding of a Q8_K step
    rounds either way between any two implementations (llama.cpp's own included), and the
    flip then grows through the layers; the float path carries the end-to-end comparison.
    """
    arch, qtype, overrides = CASES[case]
    model = make_hf_model(arch, seed=len(case), **overrides)
    path = tmp_path / "model.gguf"
    export_to_gguf(model, tokenizer, path, qtype)
    llm = cpu_llm(str(path), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV)
    calls = []
    layers = [m for m in llm.engine.model.modules()
              if getattr(m, "gguf_segments", None) or isinstance(m, GGMLLMHead)]
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args[0], out)))
             for m in layers]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS], params,
                 use_tqdm=False)
    for hook in hooks:
        hook.remove()
    checked = 0
    for module, x, y in calls:
        if isinstance(module, GGMLLMHead):
            raw = unpack_tiles(module.gguf_raw, module.qtype) if module.packed else module.gguf_raw
            parts = [(raw, module.qtype, 0, module.vocab_size, module.packed)]
        else:
            parts = [(raw_rows(module, i), seg.qtype, seg.row_offset, seg.num_rows,
                      module.gguf_packed[i]) for i, seg in enumerate(module.gguf_segments)]
        for raw, part_type, start, rows, _packed in parts:
            if part_type in K_QUANTS:
                reference = q8k_matmul_reference
            elif part_type in q8k_kernels.Q8_TYPES:  # Q8_0 / Q8_1 activations, as llama.cpp
                reference = block32_matmul_reference
            else:
                continue
            ours = y[:, start : start + rows].double()
            bias = getattr(module, "bias", None)
            if bias is not None:  # qwen2's q/k/v biases are added after the product
                ours = ours - bias[start : start + rows].double()
            ref, magnitude = reference(x, raw, part_type)
            assert ((ours - ref).abs() <= magnitude * 2**-20 + 1e-30).all(), module
            exact = x.double() @ dequantize(raw, part_type).double().t()
            assert (ours - exact).abs().max() > 1e3 * (ours - ref).abs().max()
            checked += 1
    assert checked >= 8  # every layer of the prefill and the decode steps
    # Q4_K, Q5_K and Q6_K rows are held as tiles, except a tied head's (the embedding's rows).
    packed = [getattr(m, "gguf_packed", [getattr(m, "packed", False)]) for m in layers
              if not getattr(m, "is_tied", False)]
    if q8k_kernels.packing_available() and qtype in (q4_k_m, T.Q4_K):
        assert all(all(p) for p in packed)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_dequantize_at_load_gives_the_same_tokens(arch, tmp_path, tokenizer, make_hf_model):
    model = make_hf_model(arch, seed=3)
    path = tmp_path / "model.gguf"
    stored = export_to_gguf(model, tokenizer, path, q4_k_m)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    ref = reference_continuations(model, stored, prompt_ids)
    llm, ours = run_engine(path, prompt_ids, dequantize_at_load=True,
                           quant_options={"activations": "float"})
    for ids, a, b in zip(prompt_ids, ours, ref, strict=True):
        assert_greedy_matches(model, ids, a, b)
    layer = llm.engine.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and qkv.weight.shape == (256 + 2 * 128, 256)
    if arch == "qwen3_moe":
        assert layer.mlp.experts.gate_up_proj.dtype == torch.float32


def test_accumulate_float64_multiplies_float_tensors_in_float64(tmp_path, tokenizer,
                                                               make_hf_model):
    """``accumulate=float64`` (F32 file): each linear layer and the LM head give the float64
    product of their input and the file's values, rounded once to float32."""
    model = make_hf_model("qwen3", seed=5)
    path = tmp_path / "model.gguf"
    stored = export_to_gguf(model, tokenizer, path, T.F32)
    llm = cpu_llm(str(path), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV,
              quant_options={"accumulate": "float64"})
    net = llm.engine.model
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * 3
    with torch.inference_mode():
        o_proj = net.model.layers[0].self_attn.o_proj
        head = net.lm_head
        for module, name in ((o_proj, "model.layers.0.self_attn.o_proj.weight"),
                             (head, "lm_head.weight")):
            ours = module.quant_method.apply(module, x) if module is o_proj else module(x)
            expected = (x.double() @ stored[name].double().t()).float()
            assert torch.equal(ours, expected), name
    assert isinstance(head, GGMLLMHead) and head.accumulate == "float64"
