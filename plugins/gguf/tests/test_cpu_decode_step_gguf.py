"""GGUF K-quant layers through the core's C++ decode step: the same numbers as the layer loop."""

from __future__ import annotations

import pytest
from gguf.constants import GGMLQuantizationType as T
from inference_engine import SamplingParams
from inference_engine.layers.cpu_decode_step import CpuDecodeStep, decode_step_blocker
from inference_engine.testing import cpu_llm
from inference_engine_gguf import q8k_kernels
from inference_engine_gguf.export import export_to_gguf

pytestmark = pytest.mark.skipif(q8k_kernels.kernel() is None,
                                reason="the CPU K-quant x Q8_K kernel is not built here")


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    return T.Q6_K if any(k in name for k in ("v_proj", "down_proj", "lm_head")) else T.Q4_K


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_q4_k_m_decode_step_equals_layer_loop(arch, make_hf_model, tokenizer, tmp_path,
                                              monkeypatch):
    path = tmp_path / "model.gguf"
    export_to_gguf(make_hf_model(arch), tokenizer, path, q4_k_m)
    llm = cpu_llm(str(path), dtype="float32", enable_prefix_caching=False,
                  max_num_batched_tokens=32)
    model = llm.engine.model.model
    step = model.decode_step
    assert step is not None, decode_step_blocker(model)
    calls = []
    run = CpuDecodeStep.run
    monkeypatch.setattr(CpuDecodeStep, "run",
                        lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    # 12 sequences: provided products take decode batches past the bf16 GEMV's row limit.
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))}
               for n in (7, 19, 40, 3, 4, 5, 6, 8, 9, 10, 11, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)

    def outputs() -> list:
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = outputs()
    assert len(calls) >= 15 and max(calls) == len(prompts)
    model.decode_step = None
    assert outputs() == fused


def test_float_activation_mode_keeps_the_layer_loop(make_hf_model, tokenizer, tmp_path):
    """activations=float multiplies without the q8 parts: no C product, a reason given."""
    path = tmp_path / "model.gguf"
    export_to_gguf(make_hf_model("llama"), tokenizer, path, q4_k_m)
    llm = cpu_llm(str(path), dtype="float32", quant_options={"activations": "float"})
    assert llm.engine.model.model.decode_step is None
    assert "gives the CPU step no product" in decode_step_blocker(llm.engine.model.model)
