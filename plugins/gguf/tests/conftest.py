"""Tiny random transformers models exported to GGUF (no downloads)."""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine.testing import train_tiny_tokenizer

# K-quants need rows that are multiples of 256, so every matrix has K = 256 or 512.
SHAPES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=512)


@pytest.fixture(scope="session", autouse=True)
def _kernels_built_side_by_side():
    """Every C++ kernel these tests load, built at once (one compiler per core) rather than
    one by one as tests first ask for them: about half the wall time on 2 cores."""
    from inference_engine.builtin.platforms.cpu import cpu_kernel_builds
    from inference_engine.cpu_extensions import build_cpu_extensions
    from inference_engine_gguf.cpu_kernels import GGML_MATMUL_BUILD
    from inference_engine_gguf.q8k_kernels import Q8K_BUILD
    from inference_engine_gguf.testing import AVX2_Q8K_BUILD, PORTABLE_Q8K_BUILD, cpu_has_avx2

    avx2 = [AVX2_Q8K_BUILD] if cpu_has_avx2() else []
    build_cpu_extensions([Q8K_BUILD, PORTABLE_Q8K_BUILD, *avx2, GGML_MATMUL_BUILD,
                          *cpu_kernel_builds()])


@pytest.fixture(scope="session")
def tokenizer():
    return train_tiny_tokenizer()


@pytest.fixture(scope="session")
def make_hf_model(tokenizer):
    """``(arch, seed=0, **overrides)`` -> a random float32 transformers model, eval mode."""

    def make(arch: str, seed: int = 0, **overrides):
        params = dict(SHAPES, vocab_size=len(tokenizer), tie_word_embeddings=False,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                      pad_token_id=tokenizer.pad_token_id)
        params.update(overrides)
        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        }[arch]
        if arch == "qwen3_moe":
            params = dict(params, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                          norm_topk_prob=True)
        torch.manual_seed(seed)
        model = model_cls(config_cls(**params)).float().eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:  # a wider spread than the default init: decisive greedy picks
                    p.normal_(0.0, 0.08)
                elif p.dim() == 1:
                    p.uniform_(0.8, 1.2)
        return model

    return make
