"""DeepSeek-V4 with the Triton top-k in its CSA indexers, against transformers.

On GPU platforms the indexers bind the shared Triton top-k
(:mod:`inference_engine.layers.triton_sparse_topk`); here it is switched on by hand
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


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")
def test_triton_topk_indexer_matches_transformers():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "v4_cases", Path(__file__).with_name("test_deepseek_v4.py"))
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)  # the tiny config and helpers, shared with the main tests
    assert_close, hf_model, tokens, v4_config = (cases.assert_close, cases.hf_model,
                                                  cases.tokens, cases.v4_config)
    config = v4_config()
    hf = hf_model(config)
    twin = build_twin(DeepseekV4ForCausalLM, config, saved_tensors(hf), "paged", num_blocks=32)
    indexers = [m for m in twin.model.modules() if isinstance(m, CompressedIndexer)]
    assert len(indexers) == 2
    for indexer in indexers:
        indexer.topk_impl = "triton"
    ids = tokens(30, 21)
    blocks = list(range(12))
    first = run_step(twin, [Seq(ids[:22], 0, blocks)])
    second = run_step(twin, [Seq(ids, 22, blocks)])
    assert_close(torch.cat([first, second]), hf_logits(hf, ids))
    for step in range(3):
        ids = ids + tokens(1, 50 + step)
        assert_close(run_step(twin, [Seq(ids, len(ids) - 1, blocks)]), hf_logits(hf, ids)[-1:])
