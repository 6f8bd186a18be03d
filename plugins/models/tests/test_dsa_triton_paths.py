"""DeepSeek-V3.2 and GLM-5 with the Triton top-k and sparse-decode kernels, against transformers.

The layers bind the kernels where the platform lists Triton (GPU); here they are
switched on by hand and run under ``TRITON_INTERPRET=1`` in a child pytest
(float32), so the wiring (pool views, block tables, selections) is checked end
to end, not only each kernel against its reference.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from inference_engine.layers.dsa_indexer import LightningIndexer
from inference_engine.layers.sparse_mla import SparseMLAAttention
from inference_engine.testing import run_under_triton_interpreter
from inference_engine.testing_parity import (
    Seq,
    build_twin,
    hf_logits,
    randomize,
    run_step,
    saved_tensors,
)
from inference_engine_models.deepseek_v32 import DeepseekV32ForCausalLM
from inference_engine_models.glm_moe_dsa import GlmMoeDsaForCausalLM

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

_CONFIG = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=128, intermediate_size=96, moe_intermediate_size=32,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
               first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=1.5,
               q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16, index_n_heads=32, index_head_dim=16, index_topk=8)
ARCHS = {
    "deepseek_v32": (lambda: transformers.DeepseekV32Config(num_hidden_layers=2, **_CONFIG),
                     DeepseekV32ForCausalLM),
    "glm_moe_dsa": (lambda: transformers.GlmMoeDsaConfig(
        num_hidden_layers=3, indexer_types=["full", "shared", "full"], **_CONFIG),
        GlmMoeDsaForCausalLM),
}


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_paths_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "2 passed" in stdout and "failed" not in stdout, stdout[-2000:]


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_triton_paths_match_transformers(arch):
    make_config, model_cls = ARCHS[arch]
    config = make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config))
    twin = build_twin(model_cls, config, saved_tensors(hf), "paged")
    for module in twin.model.modules():
        if isinstance(module, LightningIndexer):
            module.topk_impl = "triton"
        if isinstance(module, SparseMLAAttention):
            module.sparse_decode_impl = "triton"
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 256, (14,), generator=gen).tolist(), [7, 3, 9, 1, 4]
    blocks_a, blocks_b = [3, 8, 1, 12, 14, 0], [6, 2, 9, 4, 15]
    # A mixed step: b decodes after a 4-token chunk while a prefills past top-k (the kernel
    # serves prefill tokens too).
    run_step(twin, [Seq(b[:4], 0, blocks_b)])
    first = run_step(twin, [Seq(b, 4, blocks_b), Seq(a, 0, blocks_a)])
    assert (first[1:] - hf_logits(hf, a)).abs().max() <= 1e-4
    for step in range(3):
        a, b = a + [(step * 37) % 256], b + [(step * 91 + 5) % 256]
        logits = run_step(twin, [Seq(a, len(a) - 1, blocks_a), Seq(b, len(b) - 1, blocks_b)])
        for row, ids in ((0, a), (1, b)):
            ref = hf_logits(hf, ids)[-1]
            assert (logits[row] - ref).abs().max() <= 1e-4, (step, row)
