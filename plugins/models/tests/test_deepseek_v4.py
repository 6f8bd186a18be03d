"""DeepSeek-V4 (sliding K=V attention, CSA/HCA compressed entries, hyper-connections,
hash-routed MoE) against transformers v5 and plain references.

A tiny random model sized as shared/docs/headline-models.md: layers [sliding, CSA (rate
4), HCA (rate 8), CSA], a sliding window of 8, 32 indexer heads x 16 keeping 4
compressed entries (fewer heads tie at ReLU 0), 4 hyper-connection streams, MLPs
[hash, hash, top-k, top-k] over 4 experts with a random ``tid2eid``, YaRN on the
compressed layers. Prompts of 20+ tokens have more CSA entries than are kept, so the
indexer's choice matters (a dense twin differs). transformers runs one prompt at a
time (its left-padded batching folds pads into compression windows); our engine runs
the prompts batched, with tiny blocks, chunked prefill and forced preemption.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.engine.model_runner import attention_layers
from inference_engine.layers.compressed_attention import indexer_scores, sink_attention
from inference_engine.layers.hyper_connection import HyperConnection, HyperHead
from inference_engine.layers.kv_compressor import compress_windows
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
from inference_engine_models.deepseek_v4 import DeepseekV4ForCausalLM, checkpoint_to_ours
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

torch.set_flush_denormal(True)

NEW_TOKENS = 24
# 64 tokens of the tiny tokenizer: 8 HCA windows, 16 CSA entries, 8 sliding windows.
LONG_PROMPT = ("The quick brown fox compresses every few tokens into one entry and keeps "
               "only a handful.")
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def v4_config(vocab: int = 256, **overrides: Any) -> Any:
    params = dict(
        vocab_size=vocab, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        layer_types=["sliding_attention", CSA, HCA, CSA],
        compress_rates={CSA: 4, HCA: 8}, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=32, index_head_dim=16,
        index_topk=4, hc_mult=4, partial_rotary_factor=0.25, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 128},
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    params.update(overrides)
    return transformers.DeepseekV4Config(**params)


def hf_model(config: Any, std: float = 0.15) -> Any:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize(transformers.AutoModelForCausalLM.from_config(config), std=std)
    gen = torch.Generator().manual_seed(1)
    k, experts = config.num_experts_per_tok, config.n_routed_experts
    with torch.no_grad():  # transformers initialises tid2eid to zeros (one expert, twice)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.stack([torch.randperm(experts, generator=gen)[:k]
                                       for _ in range(buf.shape[0])]))
    return model


@pytest.fixture(scope="module")
def pair():
    config = v4_config()
    hf = hf_model(config)
    return config, hf, saved_tensors(hf)


def ours(config: Any, tensors: dict[str, torch.Tensor] | None, num_blocks: int = 64):
    return build_twin(DeepseekV4ForCausalLM, config, tensors, "paged", num_blocks=num_blocks)


# --------------------------------------------------------------------------- #
# Pieces against plain references.
# --------------------------------------------------------------------------- #


def test_hyper_connection_matches_plain_loops_and_transformers():
    """pre/post/comb, Sinkhorn and the stream merge, by element loops; and transformers'
    DeepseekV4HyperConnection / HyperHead on the same weights."""
    config = v4_config()
    gen = torch.Generator().manual_seed(5)
    n, d, t = config.hc_mult, config.hidden_size, 3
    hc = HyperConnection(n, d, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
    with torch.no_grad():
        hc.fn.copy_(0.1 * torch.randn(hc.fn.shape, generator=gen))
        hc.base.copy_(0.1 * torch.randn(hc.base.shape, generator=gen))
        hc.scale.copy_(1 + 0.2 * torch.randn(3, generator=gen))
    x = torch.randn(t, n, d, generator=gen)
    block_out = torch.randn(t, d, generator=gen)
    collapsed, post, comb = hc(x)
    merged = HyperConnection.merge(x, block_out, post, comb)
    eps = config.hc_eps
    for i in range(t):
        flat = x[i].flatten()
        flat = flat / torch.sqrt((flat * flat).mean() + config.rms_norm_eps)
        mix = [float(hc.fn[j] @ flat) for j in range((2 + n) * n)]
        s = hc.scale.tolist()
        b = hc.base.tolist()
        pre = [1 / (1 + torch.exp(torch.tensor(-(mix[j] * s[0] + b[j])))) + eps for j in range(n)]
        pst = [2 / (1 + torch.exp(torch.tensor(-(mix[n + j] * s[1] + b[n + j]))))
               for j in range(n)]
        m = [[mix[2 * n + r * n + c] * s[2] + b[2 * n + r * n + c] for c in range(n)]
             for r in range(n)]
        m = [[float(torch.tensor(row).softmax(0)[c]) + eps for c in range(n)] for row in m]
        for it in range(config.hc_sinkhorn_iters):
            if it:
                m = [[m[r][c] / (sum(m[r]) + eps) for c in range(n)] for r in range(n)]
            cols = [sum(m[r][c] for r in range(n)) for c in range(n)]
            m = [[m[r][c] / (cols[c] + eps) for c in range(n)] for r in range(n)]
        want_collapsed = sum(float(pre[j]) * x[i, j] for j in range(n))
        torch.testing.assert_close(collapsed[i], want_collapsed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(comb[i], torch.tensor(m), rtol=1e-5, atol=1e-6)
        for k in range(n):
            want = float(pst[k]) * block_out[i] + sum(m[j][k] * x[i, j] for j in range(n))
            torch.testing.assert_close(merged[i, k], want, rtol=1e-5, atol=1e-5)
    ref = hf_v4.DeepseekV4HyperConnection(config)
    head = HyperHead(n, d, eps, config.rms_norm_eps)
    ref_head = hf_v4.DeepseekV4HyperHead(config)
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            getattr(ref, name).copy_(getattr(hc, name))
        for name in ("hc_fn", "hc_base", "hc_scale"):
            getattr(head, name).copy_(0.1 * torch.randn(getattr(head, name).shape, generator=gen))
            getattr(ref_head, name).copy_(getattr(head, name))
        ref_post, ref_comb, ref_collapsed = ref(x[None])
        torch.testing.assert_close(collapsed, ref_collapsed[0])
        torch.testing.assert_close(post, ref_post[0])
        torch.testing.assert_close(comb, ref_comb[0])
        torch.testing.assert_close(head(x), ref_head(x[None])[0])


@pytest.mark.parametrize("overlap", [False, True])
def test_compress_windows_matches_plain_loops(overlap):
    """Each channel's entry is the softmax(gate + ape)-weighted sum over its window's slots
    (CSA: previous window's first half, then this window's second half)."""
    gen = torch.Generator().manual_seed(6)
    n, rate, d = 3, 4, 5
    width = 2 * d if overlap else d
    slots = 2 * rate if overlap else rate
    kv = torch.randn(n, slots, width, generator=gen)
    gate = torch.randn(n, slots, width, generator=gen)
    ape = torch.randn(rate, width, generator=gen)
    has_previous = torch.tensor([False, True, True])
    got = compress_windows(kv, gate, ape, has_previous, overlap)
    for i in range(n):
        for c in range(d):
            terms = []  # (logit, value)
            for j in range(slots):
                off = j % rate
                if overlap and j < rate:
                    if has_previous[i]:
                        terms.append((gate[i, j, c] + ape[off, c], kv[i, j, c]))
                elif overlap:
                    terms.append((gate[i, j, d + c] + ape[off, d + c], kv[i, j, d + c]))
                else:
                    terms.append((gate[i, j, c] + ape[off, c], kv[i, j, c]))
            top = max(float(z) for z, _ in terms)
            weights = [torch.exp(z - top) for z, _ in terms]
            want = sum(w * v for w, (_, v) in zip(weights, terms, strict=True)) / sum(weights)
            torch.testing.assert_close(got[i, c], want, rtol=1e-5, atol=1e-6)


def test_silu_clamped_expert_activation():
    """The experts' activation: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    from inference_engine.layers.moe.activation import ExpertActivation, gated_activation

    h = torch.tensor([[12.0, -3.0, 20.0, -15.0], [0.5, -30.0, -0.25, 2.0]])
    got = gated_activation(h, ExpertActivation("silu_clamped", limit=10.0))
    for r in range(2):
        for c in range(2):
            gate, up = min(float(h[r, c]), 10.0), max(min(float(h[r, 2 + c]), 10.0), -10.0)
            want = gate / (1 + torch.exp(torch.tensor(-gate))) * up
            assert abs(float(got[r, c]) - float(want)) < 1e-5


def test_indexer_scores_and_sink_attention_match_plain_loops():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, generator=gen)
    keys = torch.randn(5, 4, generator=gen)
    w = torch.randn(2, 3, generator=gen)
    got = indexer_scores(q, keys, w, 0.5)
    for i in range(2):
        for e in range(5):
            want = sum(float(w[i, h]) * max(float(q[i, h] @ keys[e]), 0.0) * 0.5
                       for h in range(3))
            assert abs(float(got[i, e]) - want) < 1e-5
    mask = torch.tensor([[True, False, True, True, False], [False, True, True, False, True]])
    sinks = torch.randn(3, generator=gen)
    out = sink_attention(q, keys, mask, sinks, 0.7)
    for i in range(2):
        for h in range(3):
            logits = [float(q[i, h] @ keys[s]) * 0.7 for s in range(5) if mask[i, s]]
            vals = [keys[s] for s in range(5) if mask[i, s]]
            denom = sum(torch.exp(torch.tensor(z)) for z in logits) + torch.exp(sinks[h])
            want = sum(torch.exp(torch.tensor(z)) * v for z, v in zip(logits, vals,
                                                                         strict=True)) / denom
            torch.testing.assert_close(out[i, h], want, rtol=1e-5, atol=1e-6)


def test_compressor_entries_match_transformers_compressor_across_chunks(pair):
    """Entries written chunk by chunk (chunks ending mid-window) equal transformers' HCA and
    CSA compressors run over the whole sequence."""
    config, hf, tensors = pair
    twin = ours(config, tensors)
    ids = random_tokens(37, 8)
    hidden = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(8))
    blocks = [9, 3, 14, 0, 7, 11, 2, 5, 13, 1]
    from inference_engine.testing_parity import make_step

    for layer_idx in (1, 2):
        ours_c = twin.model.model.layers[layer_idx].attn.compressor
        for lo, hi in ((0, 6), (6, 7), (7, 19), (19, 37)):
            _, _, metadata = make_step([Seq(ids[:hi], lo, blocks)])
            with torch.inference_mode():
                ours_c(hidden[lo:hi], metadata)
        rate = ours_c.rate
        num = 37 // rate
        with torch.inference_mode():
            got = ours_c.entries(torch.zeros(num, dtype=torch.int64), torch.arange(num),
                                 torch.tensor([blocks]))
        ref_c = hf.model.layers[layer_idx].self_attn.compressor
        with torch.no_grad():
            if layer_idx == 2:
                ref_kv, _ = ref_c(hidden[None], None, torch.arange(37)[None], None, 2)
            else:
                q_res = torch.zeros(1, 37, config.q_lora_rank)
                ref_kv, _ = ref_c(hidden[None], q_res, torch.arange(37)[None], None, 1)
        torch.testing.assert_close(got, ref_kv[0, 0], rtol=1e-5, atol=1e-5)


def test_indexer_selection_matches_plain_reference(pair):
    """Each query keeps the ``index_topk`` best closed entries by the indexer score."""
    config, _, tensors = pair
    twin = ours(config, tensors)
    ids = random_tokens(45, 9)
    logits = run_step(twin, [Seq(ids, 0, list(range(12)))])  # fills the pool
    assert torch.isfinite(logits).all()
    attn = twin.model.model.layers[1].attn
    indexer = attn.indexer
    hidden = torch.randn(45, config.hidden_size, generator=torch.Generator().manual_seed(9))
    q_res = torch.randn(45, config.q_lora_rank, generator=torch.Generator().manual_seed(10))
    from inference_engine.testing_parity import make_step

    _, positions, metadata = make_step([Seq(ids, 0, list(range(12)))])
    rope = twin.model.model.ropes["compress"]
    with torch.inference_mode():
        got = indexer(hidden, q_res, positions, rope.cos_sin(positions), metadata)
        num = 45 // 4
        keys = indexer.compressor.entries(torch.zeros(num, dtype=torch.int64),
                                          torch.arange(num), metadata.block_tables).float()
        q = rope.rotate(indexer.wq_b(q_res).view(45, 32, 16), *rope.cos_sin(positions)).float()
        w = indexer.weights_proj(hidden).float() * 32 ** -0.5
    for t in range(45):
        closed = (t + 1) // 4
        scores = [sum(float(w[t, h]) * max(float(q[t, h] @ keys[e]), 0.0) * 0.25
                      for h in range(32)) for e in range(closed)]
        want = set(sorted(range(closed), key=lambda e: -scores[e])[:4])
        assert {e for e in got[t].tolist() if e >= 0} == want, t


# --------------------------------------------------------------------------- #
# Our model on hand-built steps.
# --------------------------------------------------------------------------- #


def test_single_prefill_matches_transformers(pair):
    config, hf, tensors = pair
    ids = random_tokens(40, 1)
    twin = ours(config, None)
    assert twin.model.load_weights(tensors.items()) == set(tensors)  # by checkpoint name
    for module in twin.model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    assert_logits_close(run_step(twin, [Seq(ids, 0, list(range(10)))]), hf_logits(hf, ids))


def test_transformers_state_dict_loads(pair):
    """transformers' in-memory names (stacked experts, self_attn/mlp modules) load too."""
    config, hf, _ = pair
    state = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    ids = random_tokens(24, 14)
    assert_logits_close(run_step(ours(config, state), [Seq(ids, 0, list(range(6)))]),
                 hf_logits(hf, ids))


def test_prefill_in_query_tiles_matches_transformers(pair, monkeypatch):
    """With a tiny score budget a prefill is attended and indexed in tiles of 16 queries
    (each with its own window span and closed entries); the logits are unchanged."""
    from inference_engine.layers import compressed_attention
    from inference_engine_models import deepseek_v4

    monkeypatch.setattr(deepseek_v4, "SCORE_BUDGET", 1)
    monkeypatch.setattr(compressed_attention, "SCORE_BUDGET", 1)
    config, hf, tensors = pair
    ids = random_tokens(45, 15)
    twin = ours(config, tensors)
    first = run_step(twin, [Seq(ids[:37], 0, list(range(12)))])
    second = run_step(twin, [Seq(ids, 37, list(range(12)))])
    assert_logits_close(torch.cat([first, second]), hf_logits(hf, ids))


def test_checkpoint_names_map_to_ours():
    assert checkpoint_to_ours("head.weight") == "lm_head.weight"
    assert checkpoint_to_ours("embed.weight") == "model.embed_tokens.weight"
    assert checkpoint_to_ours("hc_head_fn") == "model.hc_head.hc_fn"
    assert checkpoint_to_ours("layers.3.hc_ffn_scale") == "model.layers.3.hc_ffn.scale"
    assert (checkpoint_to_ours("model.layers.1.attn.indexer.compressor.ape")
            == "model.layers.1.attn.indexer.compressor.ape")


def test_selection_matters(pair):
    """A dense twin (every entry kept) differs; only the sparse one matches transformers."""
    config, hf, tensors = pair
    ids = random_tokens(48, 3)
    blocks = list(range(12))
    sparse = run_step(ours(config, tensors), [Seq(ids, 0, blocks)])
    dense = run_step(ours(v4_config(index_topk=1000), tensors), [Seq(ids, 0, blocks)])
    assert (sparse - dense).abs().max() > 0.05
    assert_logits_close(sparse, hf_logits(hf, ids))


def test_chunked_prefill_then_mixed_decode_steps(pair):
    """Chunks ending mid-window and mid-block, two sequences per step, then decodes past
    several windows: every position's logits equal transformers' whole-prompt run."""
    config, hf, tensors = pair
    twin = ours(config, tensors)
    a, b = random_tokens(27, 4), random_tokens(22, 5)
    blocks_a = [6, 1, 12, 4, 9, 20, 17, 25, 30, 31, 32]
    blocks_b = [2, 10, 7, 14, 22, 19, 28, 33, 34, 35]
    first = run_step(twin, [Seq(a[:13], 0, blocks_a), Seq(b[:6], 0, blocks_b)])
    assert_logits_close(first[:13], hf_logits(hf, a[:13]))
    second = run_step(twin, [Seq(b, 6, blocks_b)])
    assert_logits_close(torch.cat([first[13:], second]), hf_logits(hf, b))
    c = b + random_tokens(3, 6)
    third = run_step(twin, [Seq(a, 13, blocks_a), Seq(c, 22, blocks_b)])
    assert_logits_close(third[:14], hf_logits(hf, a)[13:])
    assert_logits_close(third[14:], hf_logits(hf, c)[22:])
    for step in range(6):  # a closes CSA and HCA windows on the way, c a CSA one
        a, c = a + random_tokens(1, 30 + step), c + random_tokens(1, 40 + step)
        logits = run_step(twin, [Seq(c, len(c) - 1, blocks_b), Seq(a, len(a) - 1, blocks_a)])
        assert_logits_close(logits[:1], hf_logits(hf, c)[-1:])
        assert_logits_close(logits[1:], hf_logits(hf, a)[-1:])


def test_prefix_blocks_carry_partial_window_state(pair):
    """A second sequence reusing the first one's blocks up to token 12 (mid HCA window, the
    prefix cache's block-aligned reuse) continues from the inputs and entries stored there."""
    config, hf, tensors = pair
    twin = ours(config, tensors)
    a = random_tokens(30, 11)
    blocks_a = [3, 8, 1, 12, 5, 9, 14, 2]
    run_step(twin, [Seq(a, 0, blocks_a)])
    b = a[:12] + random_tokens(18, 12)
    logits = run_step(twin, [Seq(b, 12, blocks_a[:3] + [20, 21, 22, 23, 24])])
    assert_logits_close(logits, hf_logits(hf, b)[12:])


def test_layers_keep_graphs_off(pair):
    """No V4 cache layer claims to be graph-safe (host lists drive the compressor), so the
    runner never captures its decode steps."""
    from inference_engine.engine.model_runner import _graph_unsafe_name

    config, _, tensors = pair
    layers = attention_layers(ours(config, tensors).model)
    assert len(layers) == 4 + 3 + 2  # K=V rows, compressors, CSA indexer compressors
    assert all(_graph_unsafe_name(layer) is not None for layer in layers)


def test_quantized_checkpoints_are_refused_by_name():
    from inference_engine.builtin.attention.cpu_paged import CpuPagedAttentionBackend
    from inference_engine.interfaces.model import ModelContext
    from inference_engine_quant.fp8 import Fp8Method

    method = Fp8Method({"quant_method": "fp8", "weight_block_size": [16, 16]})
    ctx = ModelContext(v4_config(), torch.bfloat16, method, CpuPagedAttentionBackend,
                       torch.device("cpu"))
    with pytest.raises(ValueError, match="quantized DeepSeek-V4 checkpoints"):
        DeepseekV4ForCausalLM(ctx)


@pytest.mark.parametrize(("change", "message"), [
    (dict(layer_types=["sliding_attention", "bogus", HCA, CSA]), "layer type 'bogus'"),
    (dict(mlp_layer_types=["hash_moe", "dense", "moe", "moe"]), "mlp_layer_types entry"),
    (dict(num_key_value_heads=2), "one shared K=V head"),
    (dict(index_head_dim=4), "narrower than the rotary width"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
    (dict(compress_rates={CSA: 4}), "compress_rates"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    config = v4_config()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        ours(config, None)


# --------------------------------------------------------------------------- #
# The whole engine: batched prompts, chunked prefill, preemption, prefix caching.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v4")
    config = v4_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    hf = hf_model(config, std=0.1)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf.generation_config.eos_token_id = None
    return hf, path


def block_bytes(config: Any) -> int:
    specs = [layer.kv_cache_spec()
             for layer in attention_layers(build_twin(DeepseekV4ForCausalLM, config, None).model)]
    return KVCachePool.bytes_per_block_for(specs, 4)


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def assert_engine_matches(hf: Any, tokenizer: Any, prompts: list[str], outs: Any) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        key = tuple(ids)
        if key not in _REFERENCE:
            with torch.no_grad():  # one prompt at a time: transformers' padded batching is wrong
                ref = hf.generate(torch.tensor([ids]), do_sample=False,
                                  max_new_tokens=NEW_TOKENS,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            _REFERENCE[key] = ref[0, len(ids):].tolist()
        assert_greedy_matches(hf, ids, out.outputs[0].token_ids, _REFERENCE[key])


ENGINE_PROMPTS = [*PARITY_PROMPTS, LONG_PROMPT]
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_engine_greedy_parity_with_chunking_and_preemption(tokenizer, saved):
    hf, path = saved
    config = hf.config
    n_long = len(tokenizer.encode(LONG_PROMPT))
    assert n_long > 3 * config.compress_rates[HCA] and n_long > 4 * config.sliding_window
    llm = cpu_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=8,
                  kv_cache_memory=30 * block_bytes(config), enable_prefix_caching=False)
    outs = llm.generate(ENGINE_PROMPTS, PARAMS)
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert_engine_matches(hf, tokenizer, ENGINE_PROMPTS, outs)


def test_engine_greedy_parity_batched_with_prefix_cache(tokenizer, saved):
    """All prompts in one batch; a second wave reuses the long prompt's cached blocks (K=V
    rows, compressor inputs and entries) up to 60 and 52 tokens (both in the middle of an
    HCA window of 8) and still matches transformers."""
    hf, path = saved
    llm = cpu_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=256,
                  enable_prefix_caching=True)
    outs = llm.generate(ENGINE_PROMPTS, PARAMS)
    assert_engine_matches(hf, tokenizer, ENGINE_PROMPTS, outs)
    prompts = [LONG_PROMPT[:84] + " zebra", LONG_PROMPT[:78] + " zebra"]
    before = llm.engine.blocks.stats.hit_tokens
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.blocks.stats.hit_tokens - before == 60 + 52
    assert_engine_matches(hf, tokenizer, prompts, outs)


def test_engine_greedy_parity_with_ngram_speculation(tokenizer, saved):
    """Rejected draft tokens leave K=V rows, compressor inputs and entries in their slots;
    they are rewritten when the positions are computed again, so speculation stays lossless
    (V4 keeps no per-sequence state outside the paged pool)."""
    hf, path = saved
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    llm = cpu_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=16,
                  speculative_config=ngram)
    outs = llm.generate(ENGINE_PROMPTS, PARAMS)
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
    assert_engine_matches(hf, tokenizer, ENGINE_PROMPTS, outs)
