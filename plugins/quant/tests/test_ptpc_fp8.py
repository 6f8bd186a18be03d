"""``ptpc_fp8`` (online per-channel weight, per-token activation FP8) against the spec formulas."""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine.builtin.platforms.cpu import CpuPlatform
from inference_engine.sampling_params import SamplingParams
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine_quant.fp8_math import quantize_activation, quantize_weight_per_channel
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.ptpc_fp8 import PtpcFp8Method
from inference_engine_quant.quantize_memory import weight_memory_report

FP8 = torch.float8_e4m3fn
PROMPT = [7, 19, 3, 44, 120, 6, 91, 15, 230]


def spec_ptpc_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Section 5, written out: s_w[n] = amax|W[n,:]|/448, s_x[t] = amax|x[t,:]|/448."""
    s_w = w.abs().amax(dim=1, keepdim=True) / 448
    q_w = (w / s_w).clamp(-448, 448).to(FP8)
    s_x = x.abs().amax(dim=1, keepdim=True) / 448
    q_x = (x / s_x).clamp(-448, 448).to(FP8)
    return (q_x.float() @ q_w.float().t()) * s_x * s_w.t()


def test_spec_example_values():
    """The worked example of quant-formats.md section 5 (CPU _scaled_mm numbers)."""
    w = torch.tensor([[0.5, -1, 2, 0.25], [0.01, 0.02, -0.04, 0.03]])
    x = torch.tensor([[1.0, 2, 3, 4], [-0.1, 0.2, 0, 0.05]])
    q_w, s_w = quantize_weight_per_channel(w)
    q_x, s_x = quantize_activation(x, None)
    assert s_w.flatten().tolist() == pytest.approx([0.004464, 8.93e-5], rel=1e-3)
    assert s_x.flatten().tolist() == pytest.approx([0.008929, 0.000446], rel=1e-3)
    y = (q_x.float() @ q_w.float().t()) * s_x * s_w.t()
    assert y.flatten().tolist() == pytest.approx([5.214, 0.0500, -0.2375, 0.004429], rel=2e-3)
    assert q_x.float()[0, 2].item() == 320.0  # 336 ties between 320 and 352: RNE picks 320


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ptpc_base"), "qwen3")


def test_layer_equals_spec_formula():
    torch.manual_seed(0)
    method = PtpcFp8Method(platform=CpuPlatform())
    layer = torch.nn.Module()
    layer.prefix = "l"
    method.create_weights(layer, "l", 48, [40], torch.float32)
    w = torch.randn(40, 48) * 0.1
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8 and tuple(layer.weight.shape) == (48, 40)
    for m in (1, 3, 17):
        x = torch.randn(m, 48)
        got = method.apply(layer, x)
        assert torch.allclose(got, spec_ptpc_linear(x, w), atol=1e-5, rtol=1e-5)


def test_model_logits_equal_spec_reference(base):
    """Whole model: transformers with each decoder Linear replaced by the spec PTPC formula."""
    loaded = load_for_test(str(base), quantization="ptpc_fp8")
    assert loaded.model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8
    assert loaded.model.lm_head.weight.dtype == torch.float32  # LM head untouched
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32
    ours = prefill_logits(loaded, PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = hf(torch.tensor([PROMPT])).logits[0]
    # vs the unquantized model: weight and activation rounding (~3.6% RMS each per element)
    # through 14 matmuls; same bound and reasoning as test_fp8_checkpoint.PLAIN_REL.
    assert ((ours - plain).norm() / plain.norm()).item() < 0.25
    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            mod.forward = lambda x, mod=mod: spec_ptpc_linear(
                x.reshape(-1, x.shape[-1]), mod.weight).reshape(*x.shape[:-1], -1)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert ref.abs().max() > 0.5
    # Same math; float32 summation order can move an activation by one FP8 step.
    assert (ours - ref).abs().max().item() <= 2e-3


def test_llm_quantization_keyword_and_memory(base):
    llm = cpu_llm(str(base), quantization="ptpc_fp8", dtype="float32", show_progress=False,
              kv_cache_memory=1 << 22)
    dense = cpu_llm(str(base), dtype="float32", show_progress=False, kv_cache_memory=1 << 22)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len(out) == 6
    report = weight_memory_report(llm.engine.model)
    dense_report = weight_memory_report(dense.engine.model)
    # FP8: 1 byte per weight vs 4 (fp32), plus one float32 scale per output channel.
    linears = [m for m in llm.engine.model.modules() if hasattr(m, "fp8_kernel")]
    expected = sum(m.input_size * m.output_size + 4 * m.output_size for m in linears)
    assert report.linear_bytes == expected
    assert dense_report.linear_bytes == 2 * dense_report.linear_bf16_bytes
    assert report.other_bytes == dense_report.other_bytes


def test_dequantize_at_load_keeps_the_numbers(base):
    fp8 = load_for_test(str(base), quantization="ptpc_fp8")
    dense = load_for_test(str(base), quantization="ptpc_fp8", dequantize_at_load=True)
    layer = dense.model.model.layers[0].self_attn.qkv_proj
    assert layer.fp8_kernel == "reference_dequantized" and layer.weight.dtype == torch.float32
    assert weight_memory_report(dense.model).linear_bytes > 3 * weight_memory_report(
        fp8.model).linear_bytes
    a, b = prefill_logits(fp8, PROMPT), prefill_logits(dense, PROMPT)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_bf16_activations_follow_the_fp32_result():
    """In bf16 the dequantized weight and the QDQ activation round to bf16 (~2^-8 relative)."""
    torch.manual_seed(4)
    method = PtpcFp8Method(platform=CpuPlatform())
    layer = torch.nn.Module()
    method.create_weights(layer, "l", 64, [32], torch.bfloat16)
    w = (torch.randn(32, 64) * 0.1).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    x = torch.randn(5, 64).to(torch.bfloat16)
    got = method.apply(layer, x)
    assert got.dtype == torch.bfloat16
    ref = spec_ptpc_linear(x.float(), w.float())
    assert torch.allclose(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
