"""Greedy tokens through the engine from a GGUF file equal transformers on the same weights.

The reference is the transformers model holding exactly the values the file
stores, dequantized by the ``gguf`` package's numpy code. Where a token
differs it must be a genuine near-tie of the reference (top-2 within 1e-4).

With ``activations=float`` that model is run as is. With ``activations=q8`` (the
default, llama.cpp's arithmetic) each of its linear layers whose tensor the file
(read by ``gguf.GGUFReader``) stores as a K-quant first rounds its input to Q8_K,
as ggml's ``quantize_row_q8_K_ref`` does, and multiplies in float64.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from inference_engine import LLM, SamplingParams
from inference_engine.testing_parity import assert_greedy_matches, hf_greedy
from inference_engine_gguf.export import export_to_gguf
from inference_engine_gguf.testing import quantize_q8_k_numpy

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

CASES = {
    "qwen3-F16": ("qwen3", T.F16, {}),
    "qwen3-Q4_K_M": ("qwen3", q4_k_m, {}),
    "qwen3-mixed": ("qwen3", MIX_A, {}),
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
ARCHS = {"qwen3": gguf.MODEL_ARCH.QWEN3, "llama": gguf.MODEL_ARCH.LLAMA}


def q8_activation_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with ``x`` rounded to Q8_K per 256 values (numpy, ggml's reference C)."""
    flat = x.detach().reshape(-1, x.shape[-1]).float().numpy()
    qs, d = quantize_q8_k_numpy(flat)
    rounded = torch.from_numpy(qs.astype(np.float64) * np.repeat(d, 256, axis=1))
    y = rounded @ module.weight.double().t()
    if module.bias is not None:
        y = y + module.bias.double()
    return y.float().reshape(*x.shape[:-1], -1)


def use_q8_activations(model: torch.nn.Module, path, arch: str) -> None:
    """Route the linear layers the file stores as K-quants through :func:`q8_activation_linear`."""
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    names = gguf.get_tensor_name_map(ARCHS[arch], model.config.num_hidden_layers)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        ggml = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
        if ggml is None and name == "lm_head" and model.config.tie_word_embeddings:
            ggml = "token_embd.weight"
        if ggml is not None and types.get(ggml) in K_QUANTS:
            module.forward = lambda x, m=module: q8_activation_linear(m, x)


def run_engine(path, prompt_ids, **kwargs):
    llm = LLM(str(path), dtype="float32", show_progress=False, kv_cache_memory=SMALL_KV, **kwargs)
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


Q8_CASES = ["qwen3-Q4_K_M", "qwen3-mixed", "qwen3-Q4_K-tied", "llama-Q4_K_M"]


@pytest.mark.parametrize("case", Q8_CASES)
def test_q8_activations_match_transformers_with_llamacpp_arithmetic(case, tmp_path, tokenizer,
                                                                     make_hf_model):
    """The default ``activations=q8``: same greedy tokens as transformers rounding each K-quant
    layer's input to Q8_K; a K-quant layer's output is that arithmetic, not the float one."""
    arch, qtype, overrides = CASES[case]
    model = make_hf_model(arch, seed=len(case), **overrides)
    path = tmp_path / "model.gguf"
    stored = export_to_gguf(model, tokenizer, path, qtype)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    model.load_state_dict({**model.state_dict(), **stored})
    use_q8_activations(model, path, arch)
    ref = reference_continuations(model, stored, prompt_ids)
    llm, ours = run_engine(path, prompt_ids)
    for ids, a, b in zip(prompt_ids, ours, ref, strict=True):
        assert_greedy_matches(model, ids, a, b)
    # The last down projection is Q6_K or Q4_K in every case.
    down = llm.engine.model.model.layers[-1].mlp.down_proj
    hf_down = model.model.layers[-1].mlp.down_proj
    x = torch.randn(3, hf_down.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = down.quant_method.apply(down, x)
    q8_ref = q8_activation_linear(hf_down, x).double()
    float_ref = torch.nn.functional.linear(x.double(), hf_down.weight.double())
    assert (y - q8_ref).abs().max() < 1e-5 * q8_ref.abs().max()
    assert (y - float_ref).abs().max() > 1e-3 * float_ref.abs().max()


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
