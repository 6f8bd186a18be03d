"""AWQ and GPTQ checkpoints: packing, the reference against the formula, engine greedy parity.

Checkpoints are written with the formulas of AutoAWQ / GPTQ / AutoGPTQ
(:mod:`inference_engine_quant.int_testing`); the reference is transformers on
the same weights dequantized by those formulas.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.int_packing import pack_along, unpack_along
from inference_engine_quant.int_testing import awq_tensors, gptq_tensors
from inference_engine_quant.kernels.int_weight_only_gemm import dequantize_int_weight
from inference_engine_quant.mx_testing import write_quantized_checkpoint

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]
SIZES = dict(hidden_size=256, intermediate_size=384, head_dim=64)


def test_awq_order_matches_the_reference_packer():
    # AutoAWQ: nibble i of a word holds column [0, 2, 4, 6, 1, 3, 5, 7][i].
    values = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    word = int(pack_along(values, 4, dim=1, interleaved=True))
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(unpack_along(torch.tensor([[word]], dtype=torch.int32), 4, 1, True), values)


def test_gptq_packs_sequentially_along_k():
    values = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]], dtype=torch.int32)
    word = int(pack_along(values, 4, dim=0)) & 0xFFFFFFFF
    assert word == 0xF7654321
    eight = torch.tensor([[1], [2], [3], [255]], dtype=torch.int32)
    assert int(pack_along(eight, 8, dim=0)) & 0xFFFFFFFF == 0xFF030201


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_dequantize_matches_formula(bits, sym):
    torch.manual_seed(bits)
    w = torch.randn(24, 64)
    perm = torch.randperm(64)
    tensors, deq = gptq_tensors(w, bits=bits, group_size=16, sym=sym, perm=perm)
    from inference_engine_quant.int_packing import unpack_along as unpack

    zeros = (unpack(tensors[".qzeros"], bits, 1) + 1) & ((1 << bits) - 1)
    dense = dequantize_int_weight(tensors[".qweight"], tensors[".scales"].float(), zeros.float(),
                                  tensors[".g_idx"], bits, torch.float32)
    assert torch.equal(dense.t(), deq)
    assert (deq - w).abs().max() < (0.5 if bits == 4 else 0.03)  # about one step


def hf_greedy(path, prompt, n):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


def _write(root, arch, quantize, config):
    src = make_tiny_model(root / "src", arch, **SIZES)
    write_quantized_checkpoint(src, root / "q", root / "dq", quantize, quantization_config=config)
    return root / "q", root / "dq"


CASES = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
             "version": "gemm"}, lambda m, w: awq_tensors(w, 128)),
    "gptq4_sym": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                   "sym": True, "checkpoint_format": "gptq"},
                  lambda m, w: gptq_tensors(w, 4, 128, True)),
    "gptq4_asym_act_order": ({"quant_method": "gptq", "bits": 4, "group_size": 64,
                              "desc_act": True, "sym": False},
                             lambda m, w: gptq_tensors(
                                 w, 4, 64, False,
                                 perm=torch.randperm(w.shape[1],
                                                     generator=torch.Generator().manual_seed(
                                                         w.shape[1])))),
    "gptq8_v2": ({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False,
                  "sym": False, "checkpoint_format": "gptq_v2"},
                 lambda m, w: gptq_tensors(w, 8, -1, False, checkpoint_format="gptq_v2")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers_on_dequantized_weights(tmp_path, case):
    config, quantize = CASES[case]
    arch = "llama" if case == "awq" else "qwen3"
    qdir, dqdir = _write(tmp_path, arch, quantize, config)
    loaded = load_for_test(str(qdir))
    layer = loaded.model.model.layers[0].self_attn.qkv_proj
    assert layer.int_kernel == "reference" and layer.qweight.dtype == torch.int32
    ours = prefill_logits(loaded, TOKENS)
    ref = hf_logits(dqdir)
    assert torch.allclose(ours, ref, atol=2e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("case", ["awq", "gptq4_asym_act_order"])
def test_greedy_generation_matches_transformers(tmp_path, case):
    config, quantize = CASES[case]
    qdir, dqdir = _write(tmp_path, "qwen3", quantize, config)
    prompt = TOKENS[:6]
    from inference_engine import SamplingParams

    llm = cpu_llm(qdir)  # quant_method auto-detected from config.json
    ours = llm.generate([{"prompt_token_ids": prompt}],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert ours[0].outputs[0].token_ids == hf_greedy(dqdir, prompt, 12)


def test_explicit_flag_and_mismatch_errors(tmp_path):
    config, quantize = CASES["awq"]
    qdir, _ = _write(tmp_path, "qwen3", quantize, config)
    loaded = load_for_test(str(qdir), quantization="awq")
    assert loaded.model.model.layers[1].mlp.down_proj.int_bits == 4
    with pytest.raises(ValueError, match="needs a GPTQ checkpoint"):
        load_for_test(str(qdir), quantization="gptq")


def test_unsupported_settings_are_named():
    from inference_engine_quant.awq import AwqMethod
    from inference_engine_quant.gptq import GptqMethod

    with pytest.raises(ValueError, match="version 'gemv'"):
        AwqMethod({"quant_method": "awq", "version": "gemv"})
    with pytest.raises(ValueError, match="3 bits"):
        GptqMethod({"quant_method": "gptq", "bits": 3})
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        GptqMethod({"quant_method": "gptq", "checkpoint_format": "marlin"})


@pytest.mark.parametrize(("spec", "expected"), [("t4", "triton"), ("h100", "triton")])
def test_kernel_choice_follows_the_platform_list(spec, expected):
    pytest.importorskip("triton")
    from inference_engine.builtin.platforms.cpu import CpuPlatform
    from inference_engine.platforms.device_info import simulate_devices
    from inference_engine.platforms.selection import select_platform
    from inference_engine.platforms.simulated_devices import machine_from_spec
    from inference_engine_quant.int_weight_only import choose_int_weight_only_kernel

    assert choose_int_weight_only_kernel(CpuPlatform()) == "reference"
    with simulate_devices(machine_from_spec(spec)):
        platform = select_platform()
        assert choose_int_weight_only_kernel(platform) == expected
        assert ("torch._int_mm (int8 x int8)" in platform.int_gemm_kernels()) == (spec == "h100")


def test_dequantize_at_load_gives_the_same_logits(tmp_path):
    config, quantize = CASES["gptq4_asym_act_order"]
    qdir, _ = _write(tmp_path, "qwen3", quantize, config)
    packed = prefill_logits(load_for_test(str(qdir)), TOKENS)
    loaded = load_for_test(str(qdir), dequantize_at_load=True)
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert layer.int_kernel == "dense" and layer.weight.dtype == torch.float32
    assert torch.allclose(prefill_logits(loaded, TOKENS), packed, atol=1e-5, rtol=1e-5)


def test_kernel_names_for_env():
    from inference_engine.builtin.platforms.cpu import CpuPlatform
    from inference_engine_quant.awq import AwqMethod
    from inference_engine_quant.compressed_tensors_method import CompressedTensorsMethod
    from inference_engine_quant.gptq import GptqMethod

    cpu = CpuPlatform()
    assert "reference" in AwqMethod.kernel_for(cpu) == GptqMethod.kernel_for(cpu)
    assert "torch._int_mm" in CompressedTensorsMethod.kernel_for(cpu)
