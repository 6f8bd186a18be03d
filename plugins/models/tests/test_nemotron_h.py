"""Nemotron-H (Mamba-2 / attention / MoE / MLP hybrid) against transformers v5 in float32.

A tiny random model (layers [mamba, moe, attention, mlp, mamba], 8 Mamba heads of 16
channels in 2 groups, a 16-wide state, conv kernel 4, SSD chunks of 16 positions).
fp32 logits are compared on hand-built steps (one prefill; a prefill in chunks then
decodes; a decode and a prefill in one step); greedy continuations run through the
whole engine against transformers' own generate, one prompt at a time: prompts
batched together, one longer than several scan chunks, under a tiny token budget
(chunked prefill carries the state across chunks), a pool small enough to force
preemption (recompute from a clean state), async scheduling, and with prefix
caching requested (it is turned off for models with per-sequence state); ``n = 2``
seeded sampling equals the two single requests it forks into; ``n = 3`` greedy samples
each equal transformers' continuation (tokens, and logprobs within 1e-4) while the prompt
is computed once (the others fork the first sample's blocks and state at its prompt's
end), also in 8-token chunks with async scheduling, with forked samples preempted, and
with the first sample preempted or aborted before its prompt ends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.engine.model_runner import _graph_unsafe_name, attention_layers
from inference_engine.engine.state_cache import StateCachePool, state_layers
from inference_engine.layers.mamba2 import Mamba2Mixer
from inference_engine.testing import cpu_llm, train_tiny_tokenizer
from inference_engine.testing_parity import (
    PARITY_PROMPTS,
    Seq,
    assert_greedy_matches,
    build_twin,
    hf_logits,
    make_step,
    randomize,
    saved_tensors,
)
from inference_engine_models.nemotron_h import NemotronHForCausalLM

torch.set_flush_denormal(True)

ATOL = 1e-4
NEW_TOKENS = 24
LAYERS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]
# 152 tokens of the tiny tokenizer: more than nine SSD chunks of 16.
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog while the scan runs over "
                        "several chunks."] * 3)
ENGINE_PROMPTS = [*PARITY_PROMPTS, LONG_PROMPT]


def nemotron_config(vocab: int = 256, **overrides: Any) -> Any:
    params = dict(
        vocab_size=vocab, hidden_size=64, layers_block_type=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1,
        routed_scaling_factor=1.5, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    params.update(overrides)
    return transformers.NemotronHConfig(**params)


def hf_model(config: Any, std: float = 0.15) -> Any:
    torch.manual_seed(0)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), std=std)


def bind_states(model: Any, num_slots: int = 4) -> StateCachePool:
    layers = state_layers(model)
    pool = StateCachePool([layer.state_cache_spec() for layer in layers], num_slots,
                          torch.device("cpu"))
    for layer, tensors in zip(layers, pool.layer_tensors, strict=True):
        layer.state_cache = tensors
    return pool


@pytest.fixture(scope="module")
def pair():
    """(config, HF model, our model with KV and state caches bound)."""
    config = nemotron_config()
    hf = hf_model(config)
    twin = build_twin(NemotronHForCausalLM, config, saved_tensors(hf), num_blocks=64)
    bind_states(twin.model)
    return config, hf, twin.model


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step_logits(model: Any, seqs: list[Seq], slots: list[int]) -> torch.Tensor:
    ids, positions, metadata = make_step(seqs)
    metadata.state_slots = torch.tensor(slots)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, metadata))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ref.abs().max() > 0.5, "reference logits too small to compare meaningfully"
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs logit difference {diff:.2e} > {ATOL}"


# --------------------------------------------------------------------------- #
# Steps against transformers' logits.
# --------------------------------------------------------------------------- #


def test_prefill_of_several_chunks_matches_transformers(pair):
    _, hf, model = pair
    ids = tokens(70, 1)  # four full SSD chunks and a partial one
    assert_close(step_logits(model, [Seq(ids, 0, list(range(1, 19)))], [2]), hf_logits(hf, ids))


def test_chunked_prefill_then_decodes_carry_the_state(pair):
    """Chunks of 20 and 17 tokens (not chunk-aligned), then one token at a time: the conv
    window and SSM state continue from the slot each step."""
    _, hf, model = pair
    ids = tokens(50, 2)
    blocks = list(range(20, 33))
    outs = [step_logits(model, [Seq(ids[:20], 0, blocks)], [1]),
            step_logits(model, [Seq(ids[:37], 20, blocks)], [1])]
    for n in range(37, 50):
        outs.append(step_logits(model, [Seq(ids[: n + 1], n, blocks)], [1]))
    assert_close(torch.cat(outs), hf_logits(hf, ids))


def test_decode_and_prefill_in_one_step_use_their_own_slots(pair):
    _, hf, model = pair
    a, b = tokens(30, 3), tokens(25, 4)
    a_blocks, b_blocks = list(range(40, 48)), list(range(50, 57))
    step_logits(model, [Seq(a[:29], 0, a_blocks)], [3])  # a's prompt, in slot 3
    mixed = step_logits(model, [Seq(a, 29, a_blocks), Seq(b, 0, b_blocks)], [3, 0])
    assert_close(mixed[:1], hf_logits(hf, a)[-1:])
    assert_close(mixed[1:], hf_logits(hf, b))


def test_layers_declare_state_and_only_attention_declares_kv(pair):
    config, _, model = pair
    mixers = state_layers(model)
    assert [type(m) for m in mixers] == [Mamba2Mixer, Mamba2Mixer]
    assert len(attention_layers(model)) == 1
    conv, ssm = mixers[0].state_cache_spec().tensors
    assert conv.shape == (8 * 16 + 2 * 2 * 16, config.conv_kernel - 1)
    assert ssm.shape == (8, 16, 16) and ssm.dtype == torch.float32
    # Neither CUDA-graph capture nor the C++ whole-step decode take these layers.
    assert _graph_unsafe_name(mixers[0]) == "layer Mamba2Mixer"
    assert all(layer.cpu_decode_blocker() for layer in model.backbone.layers)


@pytest.mark.parametrize("change, message", [
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu' is not supported"),
    ({"moe_latent_size": 32}, "moe_latent_size"),
    ({"n_groups": 3}, "not a multiple of n_groups"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        build_twin(NemotronHForCausalLM, nemotron_config(**change), None)


def test_original_checkpoint_names_with_model_prefix_and_stacked_experts_load(pair):
    """transformers' in-memory names (``model.``, stacked ``experts.up_proj``) load too, and
    multi-token-prediction tensors are skipped."""
    config, hf, model = pair
    renamed = {}
    for name, tensor in saved_tensors(hf).items():
        renamed[name.replace("backbone.", "model.", 1)] = tensor
    for i, kind in enumerate(LAYERS):
        if kind == "moe":
            base = f"model.layers.{i}.mixer.experts"
            for proj in ("up_proj", "down_proj"):
                parts = [renamed.pop(f"{base}.{e}.{proj}.weight") for e in range(8)]
                renamed[f"{base}.{proj}"] = torch.stack(parts)
    renamed["mtp.layers.0.norm.weight"] = torch.ones(64)
    other = build_twin(NemotronHForCausalLM, config, renamed).model
    bind_states(other)
    ids = tokens(20, 5)
    assert_close(step_logits(other, [Seq(ids, 0, [1, 2, 3, 4, 5])], [0]), hf_logits(hf, ids))


# --------------------------------------------------------------------------- #
# The whole engine.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, HF model, tokenizer, transformers' greedy continuation of each prompt)."""
    path = tmp_path_factory.mktemp("nemotron_h")
    tokenizer = train_tiny_tokenizer()
    config = nemotron_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    hf = hf_model(config, std=0.1)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf.generation_config.eos_token_id = None
    refs = {}
    for prompt in ENGINE_PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():  # one prompt at a time (no padding in the reference)
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        refs[prompt] = out[0, len(ids):].tolist()
    return path, hf, tokenizer, refs


def assert_engine_matches(saved: Any, prompts: list[str], outs: Any) -> None:
    _, hf, tokenizer, refs = saved
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert_greedy_matches(hf, ids, out.outputs[0].token_ids, refs[prompt])


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tight_pool_llm(path: str, hf) -> object:
    """An engine with 4-token blocks, an 8-token step budget, 4 state slots and 47 KV blocks
    (46 usable): too small for the long prompt beside anything else, so it preempts."""
    probe = build_twin(NemotronHForCausalLM, hf.config, None).model
    block_bytes = KVCachePool.bytes_per_block_for(
        [layer.kv_cache_spec() for layer in attention_layers(probe)], 4)
    slot_bytes = StateCachePool.bytes_per_slot_for(
        [layer.state_cache_spec() for layer in state_layers(probe)])
    return cpu_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=8,
                   max_num_seqs=4, kv_cache_memory=4 * slot_bytes + 47 * block_bytes)


def test_engine_greedy_parity_tiny_budget_and_forced_preemption(saved):
    path, hf, tokenizer, _ = saved
    assert len(tokenizer.encode(LONG_PROMPT)) > 8 * hf.config.chunk_size
    # 4 state slots and 46 usable blocks: the long prompt alone needs 44 of them.
    llm = tight_pool_llm(path, hf)
    assert "state cache: 4 sequence slots" in llm.engine.capacity_message
    assert llm.engine.blocks.num_blocks == 47
    prompts = [LONG_PROMPT, *PARITY_PROMPTS]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert llm.engine.state_slots.num_free_slots == 4, "every slot is given back"
    # Where a platform could capture decode graphs, the Mamba layers keep every step eager.
    runner = llm.engine.runner
    runner.platform.supports_graph_capture = lambda: True
    possible, why = runner.graphs_possible()
    assert not possible and "layer Mamba2Mixer" in why
    assert_engine_matches(saved, prompts, outs)


def test_engine_greedy_parity_batched_async_and_prefix_caching_off(saved):
    path, _, tokenizer, _ = saved
    llm = cpu_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=512,
                  enable_prefix_caching=True, async_scheduling=True)
    assert not llm.engine.blocks.enable_prefix_caching, "hybrid models keep no prefix cache"
    outs = llm.generate(ENGINE_PROMPTS, GREEDY)
    assert_engine_matches(saved, ENGINE_PROMPTS, outs)
    again = llm.generate([LONG_PROMPT, PARITY_PROMPTS[1]], GREEDY)  # the same prompts again
    assert llm.engine.blocks.stats.hit_tokens == 0
    assert_engine_matches(saved, [LONG_PROMPT, PARITY_PROMPTS[1]], again)


def test_engine_n2_seeded_equals_two_single_requests(saved):
    path, _, tokenizer, _ = saved
    llm = cpu_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=512)
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=11, max_tokens=NEW_TOKENS,
                            ignore_eos=True)
    prompt = PARITY_PROMPTS[1]
    (forked,) = llm.generate([prompt], params)
    singles = [llm.generate([prompt], params.for_sample(i))[0].outputs[0].token_ids
               for i in range(2)]
    assert [c.token_ids for c in forked.outputs] == singles
    assert singles[0] != singles[1]


# --------------------------------------------------------------------------- #
# n > 1: the first sample computes the prompt, the others fork from it.
# --------------------------------------------------------------------------- #

GREEDY_N3 = SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def record_prompt_tokens(llm: Any, num_prompt_tokens: int) -> list[int]:
    """Count, in every forward the model runs, the tokens computed at prompt positions
    (``num_prompt_tokens``: the prompt length of every request the engine runs)."""
    counts: list[int] = []
    runner = llm.engine.runner
    execute = runner.execute_batch

    def execute_and_count(batch: Any) -> Any:
        counts.append(sum(max(0, min(c + q, num_prompt_tokens) - c)
                          for c, q in zip(batch.num_computed, batch.query_lens, strict=True)))
        return execute(batch)

    runner.execute_batch = execute_and_count
    return counts


@pytest.mark.parametrize("budget, async_scheduling", [(512, False), (8, True)])
def test_engine_n3_greedy_computes_the_prompt_once(saved, budget, async_scheduling):
    """Each of 3 greedy samples equals transformers' greedy continuation while the model
    computes the 152 prompt tokens once (not 3 times): the siblings take the first sample's
    blocks and state at its prompt's end, also when the prompt runs in 8-token chunks."""
    path, _, tokenizer, _ = saved
    # Blocks of 16: the 152-token prompt ends in a partial block, which each sibling copies.
    llm = cpu_llm(path, dtype="float32", block_size=16, max_num_batched_tokens=budget,
                  async_scheduling=async_scheduling)
    num_prompt = len(tokenizer.encode(LONG_PROMPT))
    assert num_prompt % 16
    counts = record_prompt_tokens(llm, num_prompt)
    params = GREEDY_N3.clone()
    params.logprobs = 0
    (out,) = llm.generate([LONG_PROMPT], params)
    assert sum(counts) == num_prompt, f"prompt tokens computed: {sum(counts)}"
    # Each sample's logprobs equal transformers' over its tokens: the siblings' copied
    # state and partial block carry the whole prompt (greedy tokens alone can miss a
    # small error).
    for sample in out.outputs:
        ids = out.prompt_token_ids + list(sample.token_ids)
        ref = torch.log_softmax(hf_logits(saved[1], ids[:-1]), -1)[len(out.prompt_token_ids) - 1:]
        ours = torch.tensor([entry[t].logprob for entry, t in zip(sample.logprobs,
                                                                  sample.token_ids, strict=True)])
        expected = ref.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        assert (ours - expected).abs().max() <= ATOL, sample.index
    stats = llm.engine.stats()
    assert stats["num_forked_samples"] == 2 and stats["num_samples_awaiting_fork"] == 0
    assert llm.engine.state_slots.num_free_slots == llm.engine.state_slots.num_slots
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks - 1
    assert_engine_matches(saved, [LONG_PROMPT] * 3, [_single(out, i) for i in range(3)])


def _single(out: Any, index: int) -> Any:
    """``out`` with only its ``index``-th sample, for assert_engine_matches."""
    return type("One", (), {"prompt_token_ids": out.prompt_token_ids,
                            "outputs": [out.outputs[index]]})()


def test_engine_n3_greedy_with_forced_preemption(saved):
    """A long request and an n = 3 group in a pool too small for all: forked samples are
    preempted and recompute their prompt and outputs alone; every sample still equals
    transformers' greedy continuation."""
    path, hf, _, _ = saved
    llm = tight_pool_llm(path, hf)
    scheduler = llm.engine.scheduler
    preempt, victims = scheduler._preempt, []
    scheduler._preempt = lambda request: (victims.append(request.request_id), preempt(request))
    prompt = PARITY_PROMPTS[0]
    long_out, out = llm.generate([LONG_PROMPT, prompt], [GREEDY, GREEDY_N3])
    assert llm.engine.num_forked_samples == 2
    assert any(v.endswith(("#1", "#2")) for v in victims), f"no fork preempted: {victims}"
    assert llm.engine.state_slots.num_free_slots == 4
    assert_engine_matches(saved, [LONG_PROMPT] + [prompt] * 3,
                          [long_out] + [_single(out, i) for i in range(3)])


def test_engine_n3_first_sample_preempted_or_aborted_before_its_prompt_ends(saved):
    """The first sample preempted mid-prompt recomputes it and its siblings still fork from
    it; the first sample aborted mid-prompt leaves its siblings to compute the prompt
    themselves. Every sample that runs equals transformers' greedy continuation."""
    path, _, tokenizer, refs = saved
    llm = cpu_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    outputs = {}

    def run(steps: int | None = None) -> None:
        while engine.has_unfinished_requests() and (steps is None or steps > 0):
            for output in engine.step():
                outputs[output.request_id] = output
            steps = None if steps is None else steps - 1

    aborted_prompt = PARITY_PROMPTS[1]
    assert len(tokenizer.encode(aborted_prompt)) > 8
    engine.add_request(aborted_prompt, GREEDY_N3, request_id="aborted")
    run(1)
    first = engine.scheduler.requests["aborted#0"]
    assert 0 < first.num_computed_tokens < first.num_prompt_tokens
    engine.scheduler.abort("aborted#0")
    run()
    engine.add_request(LONG_PROMPT, GREEDY_N3, request_id="preempted")
    run(3)
    first = engine.scheduler.requests["preempted#0"]
    assert 0 < first.num_computed_tokens < first.num_prompt_tokens
    engine.scheduler._preempt(first)  # what a full pool does to the newest request
    run()
    assert first.num_preemptions == 1
    assert engine.num_forked_samples == 2  # the preempted group's, after its recompute
    aborted = outputs["aborted"].outputs
    assert aborted[0].finish_reason == "abort" and aborted[0].token_ids == []
    assert all(c.token_ids == refs[aborted_prompt] for c in aborted[1:])
    assert_engine_matches(saved, [LONG_PROMPT] * 3,
                          [_single(outputs["preempted"], i) for i in range(3)])
    assert engine.state_slots.num_free_slots == engine.state_slots.num_slots


def test_speculative_decoding_is_refused_by_name(saved):
    path = saved[0]
    with pytest.raises(ValueError, match="speculative decoding is not supported: "
                                         "NemotronHForCausalLM keeps per-sequence state"):
        cpu_llm(path, dtype="float32",
                speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_budget_the_state_pool_fills_is_refused_naming_it(saved):
    path = saved[0]
    with pytest.raises(ValueError, match="per-sequence state pool of 64 slots took"):
        cpu_llm(path, dtype="float32", max_num_seqs=64, kv_cache_memory=64 * 21000)
