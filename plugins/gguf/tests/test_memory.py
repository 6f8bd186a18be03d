"""A Q4_K model holds its weights in GGML blocks: at most 0.35x of the bf16 bytes."""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T
from inference_engine.layers.linear import LinearBase
from inference_engine.testing import cpu_llm
from inference_engine_gguf.export import export_to_gguf
from inference_engine_gguf.quant_method import GGMLEmbedding, GGMLLMHead, model_weight_bytes


def load(path, **kwargs):
    return cpu_llm(str(path), dtype="float32", show_progress=False, kv_cache_memory=1 << 22,
                   **kwargs)


def test_q4_k_weights_are_at_most_035x_of_bf16(tmp_path, tokenizer, make_hf_model):
    hf = make_hf_model("qwen3", num_hidden_layers=4)
    path = tmp_path / "q4k.gguf"
    export_to_gguf(hf, tokenizer, path, T.Q4_K)
    bf16_bytes = sum(p.numel() for p in hf.parameters()) * 2
    model = load(path).engine.model
    assert isinstance(model.model.embed_tokens, GGMLEmbedding)
    assert isinstance(model.lm_head, GGMLLMHead)
    ours = model_weight_bytes(model)
    assert ours <= 0.35 * bf16_bytes, (ours, bf16_bytes)
    # The method's own report per linear layer agrees with the raw block sizes.
    for module in model.modules():
        if isinstance(module, LinearBase):
            n, k = module.output_size, module.input_size
            assert module.quant_method.weight_memory_bytes(module) == n * (k // 256) * 144

    dense = load(path, dequantize_at_load=True).engine.model
    assert model_weight_bytes(dense) == sum(p.numel() for p in hf.parameters()) * 4  # float32


def test_tied_embedding_is_held_once(tmp_path, tokenizer, make_hf_model):
    hf = make_hf_model("qwen3", tie_word_embeddings=True)
    path = tmp_path / "tied.gguf"
    export_to_gguf(hf, tokenizer, path, T.Q4_K)
    model = load(path).engine.model
    assert model.lm_head.gguf_raw.data_ptr() == model.model.embed_tokens.gguf_raw.data_ptr()
    raw = model.model.embed_tokens.gguf_raw
    # The embedding rows are dequantized on lookup, exactly as the whole table would be.
    ids = torch.tensor([0, 5, 17])
    assert torch.equal(model.model.embed_tokens(ids), model.model.embed_tokens.weight[ids])
    assert raw.dtype == torch.uint8


def test_moe_experts_stay_in_ggml_blocks(tmp_path, tokenizer, make_hf_model):
    from inference_engine_gguf.moe_method import GGMLFusedMoEMethod

    hf = make_hf_model("qwen3_moe")
    path = tmp_path / "moe.gguf"
    export_to_gguf(hf, tokenizer, path, T.Q4_K)
    model = load(path).engine.model
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, GGMLFusedMoEMethod)
    assert experts.gate_up_proj.dtype == torch.uint8
    assert model_weight_bytes(model) <= 0.35 * sum(p.numel() for p in hf.parameters()) * 2
