"""MiniMax-M3 text (MSA block-sparse attention) against transformers v5.

A tiny random model with the sizes of shared/docs/headline-models.md: layers
[full, sparse, sparse], MLPs [dense, moe, moe], 2 indexer heads x 16 (one per KV
head), blocks of 4 keys, 3 blocks kept per query (its own block among them).
Prompts of 13+ tokens already have more blocks than are kept, so the selection
matters (a dense twin differs). fp32 logits are compared on hand-built steps;
greedy continuations run through the whole engine with our prompts batched, a
tiny token budget (chunked prefill) and a tiny pool (preemption forced), while
transformers runs one prompt at a time (its left-padded batching shifts the
absolute-position blocks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.engine.model_runner import attention_layers
from inference_engine.interfaces.attention import KVCacheSpec
from inference_engine.layers.block_sparse_attention import block_sparse_decode, block_sparse_mask
from inference_engine.layers.msa_indexer import MSAIndexer, block_scores
from inference_engine.testing import cpu_llm, train_tiny_tokenizer
from inference_engine.testing_parity import (
    PARITY_PROMPTS,
    Seq,
    assert_greedy_matches,
    assert_logits_close,
    build_twin,
    hf_logits,
    random_tokens,
    randomize,
    run_step,
    saved_tensors,
)
from inference_engine_models.minimax_m3 import (
    MiniMaxM3SparseForConditionalGeneration,
    MiniMaxM3VLForCausalLM,
)
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_m3

torch.set_flush_denormal(True)

NEW_TOKENS = 24
# A prompt of several index blocks (4 tokens each): a few sentences of the tiny tokenizer.
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog while the model keeps only a few "
               "blocks of keys for every query, and the rest of the context is skipped by the "
               "sparse attention layers of this tiny test model.")


def m3_config(vocab: int = 256, **overrides: Any) -> Any:
    params = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=32, dense_intermediate_size=96,
        shared_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, routed_scaling_factor=2.0,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse"], index_n_heads=2, index_head_dim=16,
        index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    params.update(overrides)
    return transformers.MiniMaxM3VLTextConfig(**params)


def hf_model(config: Any, std: float = 0.15) -> Any:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), std=std)


@pytest.fixture(scope="module")
def pair():
    """(config, HF model, saved checkpoint tensors)."""
    config = m3_config()
    hf = hf_model(config)
    return config, hf, saved_tensors(hf)


def ours(config: Any, tensors: dict[str, torch.Tensor] | None, num_blocks: int = 32):
    return build_twin(MiniMaxM3VLForCausalLM, config, tensors, "paged", num_blocks=num_blocks)


# --------------------------------------------------------------------------- #
# Pieces against plain references.
# --------------------------------------------------------------------------- #


def _plain_selection(q: torch.Tensor, keys: torch.Tensor, pos: int, block: int, topk: int,
                     local: int) -> list[set[int]]:
    """Loops: each head's max-per-block scores over visible keys, local blocks forced (the
    selection's own tests, against this and the Triton top-k: core/tests/test_msa_indexer.py)."""
    out = []
    for h in range(q.shape[0]):
        scores: dict[int, float] = {}
        for s in range(pos + 1):
            value = float(q[h] @ keys[s])
            scores[s // block] = max(scores.get(s // block, float("-inf")), value)
        forced = {max(pos // block - j, 0) for j in range(local)}
        rest = sorted((b for b in scores if b not in forced), key=lambda b: -scores[b])
        out.append(forced | set(rest[:max(topk - len(forced), 0)]))
    return out


def test_indexer_selection_matches_transformers_indexer(pair):
    """Our selection for one prompt equals transformers' MiniMaxM3VLIndexer output."""
    config, hf, tensors = pair
    layer = hf.model.layers[1].self_attn
    ids = torch.tensor([random_tokens(30, 9)])
    with torch.no_grad():
        hidden = hf.model.layers[1].input_layernorm(hf.model.embed_tokens(ids))
        position_ids = torch.arange(30)[None]
        rope = hf.model.rotary_emb(hidden, position_ids)
        ref = layer.indexer(hidden, rope, None, position_ids)[0]  # [H, S, k]
    twin = ours(config, tensors)
    indexer = twin.model.model.layers[1].self_attn.indexer
    from inference_engine.testing_parity import make_step

    _, positions, metadata = make_step([Seq(ids[0].tolist(), 0, list(range(8)))])
    with torch.inference_mode():
        table = twin.model.model.rotary_emb.lookup(positions)
        got = indexer(hidden[0], positions, table, metadata)  # [S, H, k]
    for s in range(30):
        for h in range(2):
            want = {b for b in ref[h, s].tolist() if b >= 0}
            assert {b for b in got[s, h].tolist() if b >= 0} == want, (s, h)


def test_bf16_indexer_selection_matches_transformers_in_bf16(pair):
    """In bf16 (keys cached in bf16, scored in float32) our selection equals transformers'
    bf16 indexer except at near-ties: wherever the kept sets differ, transformers' own block
    scores at the boundary (its k-th and (k+1)-th best) are within bf16 rounding (2^-6
    relative) of each other."""
    from inference_engine.testing_parity import make_step

    config, _, tensors = pair
    hf16 = hf_model(m3_config()).to(torch.bfloat16)
    twin = _bf16_twin(tensors)
    k = config.index_topk_blocks
    mismatches = 0
    for layer_idx in (1, 2):
        hf_indexer = hf16.model.layers[layer_idx].self_attn.indexer
        indexer = twin.model.model.layers[layer_idx].self_attn.indexer
        hidden = torch.randn(1, 60, 64, generator=torch.Generator().manual_seed(layer_idx))
        hidden = hidden.to(torch.bfloat16)
        position_ids = torch.arange(60)[None]
        with torch.no_grad():
            cos, sin = hf16.model.rotary_emb(hidden, position_ids)
            ref = hf_indexer(hidden, (cos, sin), None, position_ids)[0]
            q = hf_indexer.q_norm(hf_indexer.q_proj(hidden).view(1, 60, 2, 16)).transpose(1, 2)
            key = hf_indexer.k_norm(hf_indexer.k_proj(hidden).view(1, 60, 1, 16)).transpose(1, 2)
            q, key = hf_m3.apply_rotary_pos_emb(q, key, cos[..., :16], sin[..., :16])
            ref_scores = block_scores(q[0].transpose(0, 1).float(), key[0, 0].float(),
                                      torch.arange(60), 4)  # [S, H, blocks]
        _, positions, metadata = make_step([Seq(list(range(60)), 0, list(range(15)))])
        with torch.inference_mode():
            got = indexer(hidden[0], positions, twin.model.model.rotary_emb.lookup(positions),
                          metadata)
        for s in range(60):
            for h in range(2):
                want = {b for b in ref[h, s].tolist() if b >= 0}
                if {b for b in got[s, h].tolist() if b >= 0} == want:
                    continue
                mismatches += 1
                local = s // 4
                others = ref_scores[s, h].clone()
                others[local] = float("-inf")
                best = others.topk(k).values  # [k]: the k-1 kept others, then the first out
                gap = (best[k - 2] - best[k - 1]).abs()
                assert gap <= 2 ** -6 * best[k - 2].abs(), (layer_idx, s, h, float(gap))
    assert mismatches <= 6, f"{mismatches} of 240 selections differ"


def _bf16_twin(tensors: dict[str, torch.Tensor]) -> Any:
    from inference_engine.builtin.attention.cpu_paged import CpuPagedAttentionBackend
    from inference_engine.builtin.quant.unquantized import UnquantizedMethod
    from inference_engine.interfaces.model import ModelContext
    from inference_engine.testing_parity import Twin

    ctx = ModelContext(m3_config(), torch.bfloat16, UnquantizedMethod(),
                       CpuPagedAttentionBackend, torch.device("cpu"))
    model = MiniMaxM3VLForCausalLM(ctx).eval()
    with torch.no_grad():
        model.load_weights(tensors.items())
    layers = attention_layers(model)
    pool = KVCachePool([layer.kv_cache_spec() for layer in layers], 4, 32, torch.device("cpu"))
    for i, layer in enumerate(layers):
        layer.kv_cache = pool.layer_views(i)
    return Twin(model, pool)


def test_block_sparse_decode_matches_masked_attention():
    """The gathered decode equals dense attention under the block mask (paged, GQA)."""
    gen = torch.Generator().manual_seed(2)
    page, pages, g, d, h = 4, 12, 2, 8, 4
    k_cache = torch.randn(pages, page, g, d, generator=gen)
    v_cache = torch.randn(pages, page, g, d, generator=gen)
    tables = torch.tensor([[5, 2, 9, 0, 7, 11], [3, 8, 1, 6, 10, 4]])
    seq_lens = torch.tensor([22, 13])
    selection = torch.tensor([[[0, 3, 5], [1, 5, -1]], [[0, 1, 3], [2, 3, -1]]])
    q = torch.randn(2, h, d, generator=gen)
    got = block_sparse_decode(q, k_cache, v_cache, selection, tables, seq_lens, 4, 0.3)
    for i in range(2):
        n = int(seq_lens[i])
        keys = k_cache[tables[i]].reshape(-1, g, d)[:n].repeat_interleave(2, dim=1)
        values = v_cache[tables[i]].reshape(-1, g, d)[:n].repeat_interleave(2, dim=1)
        mask = block_sparse_mask(selection[i:i + 1], torch.tensor([n - 1]), n, 4, 2)[:, 0]
        scores = torch.einsum("hd,shd->hs", q[i], keys) * 0.3
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        torch.testing.assert_close(got[i], torch.einsum("hs,shd->hd", probs, values))


def test_block_sparse_decode_reads_a_float8_cache_with_its_scales():
    """On float8 caches the decode equals the same decode over the dequantised values
    (codes times the per-tensor scales), and stays near the unquantised result."""
    gen = torch.Generator().manual_seed(3)
    k32 = torch.randn(6, 4, 2, 8, generator=gen)
    v32 = torch.randn(6, 4, 2, 8, generator=gen)
    k_scale, v_scale = 0.5, 0.25
    k8 = (k32 / k_scale).to(torch.float8_e4m3fn)
    v8 = (v32 / v_scale).to(torch.float8_e4m3fn)
    tables = torch.tensor([[4, 1, 5, 0]])
    seq_lens = torch.tensor([15])
    selection = torch.tensor([[[0, 2, 3], [1, 3, -1]]])
    q = torch.randn(1, 4, 8, generator=gen)
    got = block_sparse_decode(q, k8, v8, selection, tables, seq_lens, 4, 0.35, k_scale, v_scale)
    ref = block_sparse_decode(q, k8.float() * k_scale, v8.float() * v_scale, selection, tables,
                              seq_lens, 4, 0.35)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    exact = block_sparse_decode(q, k32, v32, selection, tables, seq_lens, 4, 0.35)
    # e4m3 keeps 3 mantissa bits (relative error <= 1/16 per value); outputs are O(1).
    assert (got - exact).abs().max() < 0.25


def test_fp8_indexer_scores_quantised_queries_and_keys(pair):
    """``indexer_dtype="fp8"``: keys cached as e4m3 codes + a float32 scale per token, and the
    selection is the plain reference's on independently quantised q and k; queries whose
    context fits the kept blocks are unchanged (logits equal transformers')."""
    from inference_engine.layers.dsa_indexer import dequantize_fp8_rows, quantize_fp8_rows
    from inference_engine.testing_parity import make_step

    config, hf, tensors = pair
    twin = ours(m3_config(indexer_dtype="fp8"), tensors)
    assert KVCacheSpec(1, 1, 16 + 4, torch.uint8) in twin.pool.specs
    ids = random_tokens(30, 9)
    _, positions, metadata = make_step([Seq(ids, 0, list(range(8)))])
    indexer = twin.model.model.layers[1].self_attn.indexer
    hidden = torch.randn(30, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        table = twin.model.model.rotary_emb.lookup(positions)
        got = indexer(hidden, positions, table, metadata)
        q = indexer._rotate(table, indexer.q_norm(indexer.q_proj(hidden).view(30, 2, 16)))
        k = indexer._rotate(table, indexer.k_norm(indexer.k_proj(hidden).view(30, 1, 16)))[:, 0]
        q = dequantize_fp8_rows(*quantize_fp8_rows(q))
        k = dequantize_fp8_rows(*quantize_fp8_rows(k))
    for s in range(30):
        ref = _plain_selection(q[s], k, s, 4, 3, 1)
        for h in range(2):
            assert {b for b in got[s, h].tolist() if b >= 0} == ref[h], (s, h)
    twin = ours(m3_config(indexer_dtype="fp8"), tensors)
    logits = run_step(twin, [Seq(ids, 0, list(range(8)))])
    assert torch.isfinite(logits).all()
    fits = 4 * config.index_topk_blocks
    assert_logits_close(logits[:fits], hf_logits(hf, ids)[:fits])


# --------------------------------------------------------------------------- #
# Our model on hand-built steps.
# --------------------------------------------------------------------------- #


def test_single_prefill_matches_transformers(pair):
    config, hf, tensors = pair
    ids = random_tokens(30, 1)
    twin = ours(config, None)
    assert twin.model.load_weights(tensors.items()) == set(tensors)  # by checkpoint name
    for module in twin.model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    logits = run_step(twin, [Seq(ids, 0, [5, 2, 7, 0, 9, 11, 3, 14])])
    assert_logits_close(logits, hf_logits(hf, ids))


@pytest.mark.parametrize(("change", "message"), [
    (dict(layer_types=["full_attention", "bogus", "minimax_m3_sparse"]), "layer type 'bogus'"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types entry 'moe'"),
    (dict(index_n_heads=4), "index_n_heads"),
    (dict(index_head_dim=8), "narrower than the rotary width"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    config = m3_config()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        ours(config, None)


def test_sparse_layers_cache_an_indexer_key_per_token(pair):
    config, _, tensors = pair
    twin = ours(config, tensors)
    indexers = [m for m in twin.model.modules() if isinstance(m, MSAIndexer)]
    assert [m.prefix for m in indexers] == [f"model.layers.{i}.self_attn.indexer"
                                            for i in (1, 2)]
    assert KVCacheSpec(1, 1, 16, torch.float32) in twin.pool.specs
    assert len(twin.pool.specs) == config.num_hidden_layers + 2


def test_selection_matters(pair):
    """A dense twin (all blocks kept) differs; only the sparse one matches transformers."""
    config, hf, tensors = pair
    ids = random_tokens(40, 3)
    blocks = [5, 2, 7, 0, 9, 11, 3, 14, 1, 8]
    sparse = run_step(ours(config, tensors), [Seq(ids, 0, blocks)])
    dense = run_step(ours(m3_config(index_topk_blocks=1000), tensors), [Seq(ids, 0, blocks)])
    assert (sparse - dense).abs().max() > 0.05
    assert_logits_close(sparse, hf_logits(hf, ids))


def test_chunked_prefill_then_mixed_decode_steps(pair):
    config, hf, tensors = pair
    twin = ours(config, tensors)
    a, b = random_tokens(21, 4), random_tokens(17, 5)
    blocks_a, blocks_b = [6, 1, 12, 4, 9, 20, 17, 25], [2, 10, 7, 14, 22, 19, 28]
    first = run_step(twin, [Seq(a[:14], 0, blocks_a), Seq(b[:6], 0, blocks_b)])
    assert_logits_close(first[:14], hf_logits(hf, a[:14]))
    second = run_step(twin, [Seq(b, 6, blocks_b)])
    assert_logits_close(torch.cat([first[14:], second]), hf_logits(hf, b))
    c = b + random_tokens(2, 6)
    third = run_step(twin, [Seq(a, 14, blocks_a), Seq(c, 17, blocks_b)])
    assert_logits_close(third[:7], hf_logits(hf, a)[14:])
    assert_logits_close(third[7:], hf_logits(hf, c)[17:])
    for step in range(6):  # decodes past the kept blocks: the gathered sparse path
        a, c = a + random_tokens(1, 30 + step), c + random_tokens(1, 40 + step)
        logits = run_step(twin, [Seq(c, len(c) - 1, blocks_b), Seq(a, len(a) - 1, blocks_a)])
        assert_logits_close(logits[:1], hf_logits(hf, c)[-1:])
        assert_logits_close(logits[1:], hf_logits(hf, a)[-1:])


def vl_model(vocab: int = 256, std: float = 0.15, **text_overrides: Any) -> Any:
    """transformers' VL model (a one-layer vision tower) around the tiny text config."""
    text = m3_config(vocab, **text_overrides)
    vision = transformers.MiniMaxM3VLVisionConfig(hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2)
    config = transformers.MiniMaxM3VLConfig(text_config=text.to_dict(),
                                            vision_config=vision.to_dict(),
                                            projector_hidden_size=64)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize(hf_m3.MiniMaxM3SparseForConditionalGeneration(config), std=std)


def test_vl_checkpoint_runs_text_only():
    """The VL wrapper's checkpoint (language_model + vision tower) loads text-only and its
    logits are transformers' MiniMaxM3SparseForConditionalGeneration's on text."""
    hf = vl_model()
    config = hf.config
    tensors = saved_tensors(hf)
    # transformers writes the VL checkpoint in MiniMax's original layout.
    assert any(name.startswith("vision_tower.") for name in tensors)
    assert any(name.startswith("language_model.model.layers.") for name in tensors)
    twin = build_twin(MiniMaxM3SparseForConditionalGeneration, config, None, "paged",
                      num_blocks=32)
    assert twin.model.load_weights(tensors.items()) == set(tensors)
    for module in twin.model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    ids = random_tokens(26, 12)
    logits = run_step(twin, [Seq(ids, 0, list(range(7)))])
    assert_logits_close(logits, hf_logits(hf, ids))


def test_original_checkpoint_names_load(pair):
    """MiniMax's original names (per-expert w1/w3/w2, block_sparse_moe, index_*, split dense
    gate/up, the language_model. prefix) load to the same logits."""
    config, hf, tensors = pair
    original: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        new = "language_model." + name
        new = new.replace(".mlp.experts.", ".block_sparse_moe.experts.")
        new = new.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        new = new.replace(".self_attn.indexer.", ".self_attn.index_")
        if new.endswith("experts.gate_up_proj"):
            for e, rows in enumerate(tensor):
                gate, up = rows.chunk(2)
                original[new.replace("gate_up_proj", f"{e}.w1.weight")] = gate
                original[new.replace("gate_up_proj", f"{e}.w3.weight")] = up
        elif new.endswith("experts.down_proj"):
            for e, rows in enumerate(tensor):
                original[new.replace("down_proj", f"{e}.w2.weight")] = rows
        elif new.endswith("mlp.gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            original[new.replace("gate_up_proj", "gate_proj")] = gate
            original[new.replace("gate_up_proj", "up_proj")] = up
        else:
            original[new] = tensor
    twin = ours(config, original)
    ids = random_tokens(22, 13)
    assert_logits_close(run_step(twin, [Seq(ids, 0, list(range(6)))]), hf_logits(hf, ids))


# --------------------------------------------------------------------------- #
# The whole engine: batched prompts, chunked prefill, preemption.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


def saved_model(tokenizer: Any, path: Any) -> Any:
    config = m3_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    hf = hf_model(config, std=0.1)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf.generation_config.eos_token_id = None
    return hf


def block_bytes(config: Any) -> int:
    specs = [layer.kv_cache_spec()
             for layer in attention_layers(build_twin(MiniMaxM3VLForCausalLM, config, None).model)]
    return KVCachePool.bytes_per_block_for(specs, 4)


def assert_engine_matches(hf: Any, tokenizer: Any, prompts: list[str], outs: Any) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():  # one prompt at a time: transformers' padded batching is wrong
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert_greedy_matches(hf, ids, out.outputs[0].token_ids, ref[0, len(ids):].tolist())


ENGINE_PROMPTS = [*PARITY_PROMPTS, LONG_PROMPT]


@pytest.mark.slow
def test_engine_greedy_parity_with_chunking_and_preemption(tokenizer, tmp_path):
    hf = saved_model(tokenizer, tmp_path)
    assert len(tokenizer.encode(LONG_PROMPT)) > 4 * hf.config.index_topk_blocks * 3
    llm = cpu_llm(tmp_path, dtype="float32", block_size=4, max_num_batched_tokens=8,
                  kv_cache_memory=46 * block_bytes(hf.config), enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(ENGINE_PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert_engine_matches(hf, tokenizer, ENGINE_PROMPTS, outs)


@pytest.mark.slow
def test_engine_greedy_parity_batched_with_prefix_cache(tokenizer, tmp_path):
    """All prompts in one batch with a roomy budget; a second wave reuses cached blocks
    (K/V and indexer keys) of the long prompt."""
    hf = saved_model(tokenizer, tmp_path)
    llm = cpu_llm(tmp_path, dtype="float32", block_size=4, max_num_batched_tokens=256,
                  enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(ENGINE_PROMPTS, params)
    assert_engine_matches(hf, tokenizer, ENGINE_PROMPTS, outs)
    prompts = [LONG_PROMPT + " And then", LONG_PROMPT + " blocks"]
    outs = llm.generate(prompts, params)
    assert llm.engine.blocks.stats.hit_tokens > 0
    assert_engine_matches(hf, tokenizer, prompts, outs)


@pytest.mark.slow
def test_engine_runs_the_vl_checkpoint_text_only(tokenizer, tmp_path):
    hf = vl_model(len(tokenizer), std=0.1, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    llm = cpu_llm(tmp_path, dtype="float32", block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [PARITY_PROMPTS[1], LONG_PROMPT]
    assert_engine_matches(hf, tokenizer, prompts, llm.generate(prompts, params))
