"""Multi-step greedy windows on a GGUF Q4_K_M file (q8 activations): the window embeds from
the GGML rows read once into a float32 table and multiplies by the head's q8 product; its
tokens equal the one-step path's."""

from __future__ import annotations

import pytest
from gguf.constants import GGMLQuantizationType as T
from inference_engine import SamplingParams
from inference_engine.layers.cpu_greedy_window import greedy_window_blocker
from inference_engine.testing import cpu_llm
from inference_engine_gguf import q8k_kernels
from inference_engine_gguf.export import export_to_gguf

pytestmark = pytest.mark.skipif(q8k_kernels.kernel() is None,
                                reason="the CPU K-quant x Q8_K kernel is not built here")


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    return T.Q6_K if any(k in name for k in ("v_proj", "down_proj", "lm_head")) else T.Q4_K


def test_q4_k_m_windows_equal_one_step(make_hf_model, tokenizer, tmp_path):
    path = tmp_path / "model.gguf"
    export_to_gguf(make_hf_model("qwen3"), tokenizer, path, q4_k_m)
    one = cpu_llm(str(path), dtype="float32", num_scheduler_steps=1)
    multi = cpu_llm(str(path), dtype="float32", num_scheduler_steps=4)
    assert multi.engine.multi_step is not None, greedy_window_blocker(multi.engine.model)
    free = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True)
    for prompt in (list(range(5, 12)), list(range(9, 40))):
        before = multi.engine.multi_step.num_windows
        ours = multi.generate({"prompt_token_ids": prompt}, free, use_tqdm=False)[0].outputs[0]
        ref = one.generate({"prompt_token_ids": prompt}, free, use_tqdm=False)[0].outputs[0]
        assert multi.engine.multi_step.num_windows - before == 5  # 18 tokens: 4+4+4+4+2
        assert ours.token_ids == ref.token_ids
        # A stop id inside a window ends it there.
        stop = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True,
                              stop_token_ids=[ref.token_ids[7]])
        ours = multi.generate({"prompt_token_ids": prompt}, stop, use_tqdm=False)[0].outputs[0]
        ref = one.generate({"prompt_token_ids": prompt}, stop, use_tqdm=False)[0].outputs[0]
        assert (ours.token_ids, ours.finish_reason) == (ref.token_ids, ref.finish_reason)


def test_float_activation_mode_has_no_window(make_hf_model, tokenizer, tmp_path):
    path = tmp_path / "model.gguf"
    export_to_gguf(make_hf_model("llama"), tokenizer, path, q4_k_m)
    llm = cpu_llm(str(path), dtype="float32", quant_options={"activations": "float"})
    assert llm.engine.multi_step is None
    assert "no C++ decode step" in greedy_window_blocker(llm.engine.model)
