"""DeepSeek-V4 with its Triton kernels (the CSA indexers' top-k, the decode attention),
against transformers.

On GPU platforms the indexers bind the shared Triton top-k
(:mod:`inference_engine.layers.triton_sparse_topk`) and the layers the Triton decode
attention (:mod:`inference_engine.layers.triton_sink_attention`); here both are switched on by hand
and run under ``TRITON_INTERPRET=1`` in a child pytest (float32), so the wiring
(entries gathered from the pool, visibility masks, ``-1`` padding) is checked end to
end on a prefill, a chunk that ends mid-window and decodes.
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.layers.compressed_attention import CompressedIndexer
from inference_engine.testing import run_under_triton_interpreter
from inference_engine.testing_parity import Seq, build_twin, hf_logits, run_step, saved_tensors
from inference_engine_models.deepseek_v4 import DeepseekV4ForCausalLM

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the case runs in the child")
def test_kernel_paths_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "1 passed" in stdout and "failed" not in stdout, stdout[-2000:]


class ListingPlatform:
    """A stand-in platform: the CPU device type and a ``fused_op_kernels()`` list."""

    device_type = "cpu"

    def __init__(self, kernels: list[str]) -> None:
        self.kernels = kernels

    def fused_op_kernels(self) -> list[str]:
        return list(self.kernels)

    def moe_kernels(self) -> list[str]:
        return ["torch"]


@pytest.mark.skipif(INTERPRETING, reason="runs in the parent")
@pytest.mark.parametrize("kernels", [["triton", "torch"], ["cpu", "torch"]])
def test_layers_bind_the_kernels_their_platform_lists(kernels):
    """Chosen once at build: Triton decode attention and top-k where the platform lists
    Triton, the torch references otherwise."""
    pytest.importorskip("triton")
    import transformers
    from inference_engine.layers.compressed_attention import sink_attention
    from inference_engine.layers.triton_sink_attention import sink_attention_triton
    from inference_engine.platforms.selection import set_current_platform
    from inference_engine_models.deepseek_v4 import DeepseekV4Attention

    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    config = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, head_dim=16, q_lora_rank=16, n_routed_experts=2,
        num_experts_per_tok=1, layer_types=["sliding_attention", csa],
        mlp_layer_types=["moe", "moe"], compress_rates={csa: 4, hca: 8}, o_groups=2,
        o_lora_rank=8, index_n_heads=4, index_head_dim=8, index_topk=2, hc_mult=2,
        partial_rotary_factor=0.5)
    set_current_platform(ListingPlatform(kernels))  # type: ignore[arg-type]
    try:
        twin = build_twin(DeepseekV4ForCausalLM, config, None, "paged")
    finally:
        set_current_platform(None)
    triton = kernels[0] == "triton"
    attns = [m for m in twin.model.modules() if isinstance(m, DeepseekV4Attention)]
    assert all(a.decode_attention is (sink_attention_triton if triton else sink_attention)
               for a in attns)
    indexers = [m for m in twin.model.modules() if isinstance(m, CompressedIndexer)]
    assert [i.topk_impl for i in indexers] == ["triton" if triton else "cpu"]


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")
def test_triton_paths_match_transformers():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "v4_cases", Path(__file__).with_name("test_deepseek_v4.py"))
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)  # the tiny config and helpers, shared with the main tests
    assert_close, hf_model, tokens, v4_config = (cases.assert_logits_close, cases.hf_model,
                                                  cases.random_tokens, cases.v4_config)
    config = v4_config()
    hf = hf_model(config)
    twin = build_twin(DeepseekV4ForCausalLM, config, saved_tensors(hf), "paged", num_blocks=32)
    indexers = [m for m in twin.model.modules() if isinstance(m, CompressedIndexer)]
    assert len(indexers) == 2
    for indexer in indexers:
        indexer.topk_impl = "triton"
    from inference_engine.layers.triton_sink_attention import sink_attention_triton
    from inference_engine_models.deepseek_v4 import DeepseekV4Attention

    for attn in twin.model.modules():
        if isinstance(attn, DeepseekV4Attention):
            attn.decode_attention = sink_attention_triton
    ids = tokens(26, 21)  # 6 CSA entries, 4 kept: the selection matters
    blocks = list(range(12))
    first = run_step(twin, [Seq(ids[:18], 0, blocks)])
    second = run_step(twin, [Seq(ids, 18, blocks)])
    assert_close(torch.cat([first, second]), hf_logits(hf, ids))
    for step in range(2):
        ids = ids + tokens(1, 50 + step)
        assert_close(run_step(twin, [Seq(ids, len(ids) - 1, blocks)]), hf_logits(hf, ids)[-1:])
