"""Whisper in the engine against transformers 5.x on the same log-mel features.

A tiny random WhisperForConditionalGeneration (built and saved here with a
locally trained tokenizer) decodes synthesised audio: the engine's greedy tokens
must equal transformers' greedy ``generate`` (GenerationMixin's, so no
Whisper-specific logits processors) for every clip, whether the requests run
together, join while others decode, are cut into prefill chunks or preempted.
The engine runs on the CPU platform, as the reference does. The cross-attention
K/V of each request's encoder output live in the engine's per-sequence state pool:
a slot per running request, sized at start-up beside the paged KV, freed with it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inference_engine import SamplingParams
from inference_engine.audio.whisper_features import WhisperFeatureConfig, WhisperFeatures
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_audio import make_tiny_whisper, tone
from transformers import AutoTokenizer, WhisperForConditionalGeneration
from transformers.generation.utils import GenerationMixin

torch.set_flush_denormal(True)

MAX_NEW = 14
PROMPT_TOKENS = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper"), chunk_length=10)


@pytest.fixture(scope="module")
def features(whisper_dir) -> torch.Tensor:
    rng = np.random.default_rng(1)
    clips = [np.zeros(16000, np.float32), (0.5 * rng.standard_normal(80000)).astype(np.float32),
             tone(8.0, freqs=(300.0,)), tone(20.0, freqs=(1000.0, 3000.0, 150.0), noise=0.2)]
    return WhisperFeatures(WhisperFeatureConfig.from_pretrained(str(whisper_dir)))(clips)


@pytest.fixture(scope="module")
def prompt(whisper_dir) -> list[int]:
    return AutoTokenizer.from_pretrained(whisper_dir).convert_tokens_to_ids(PROMPT_TOKENS)


@pytest.fixture(scope="module")
def reference(whisper_dir, features, prompt) -> list[list[int]]:
    """transformers' greedy tokens per clip, up to and including the first EOS."""
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = GenerationMixin.generate(
            model, input_features=features,
            decoder_input_ids=torch.tensor([prompt] * len(features)),
            max_new_tokens=MAX_NEW, do_sample=False)
    result = []
    for row in out[:, len(prompt):].tolist():
        result.append(row[: row.index(eos) + 1] if eos in row else row)
    return result


@pytest.fixture(scope="module")
def llm(whisper_dir):
    return cpu_llm(whisper_dir, max_num_seqs=8)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, skip_special_tokens=False)


def _slots_in_use(engine) -> int:
    slots = engine.state_slots
    return slots.num_slots - slots.num_free_slots


def _slot_bytes(whisper_dir) -> int:
    """One sequence's cross-attention K/V in float32: per decoder layer, K and V of
    ``[heads, max_source_positions, head_dim]``."""
    from transformers import WhisperConfig

    cfg = WhisperConfig.from_pretrained(whisper_dir)
    return cfg.decoder_layers * 2 * cfg.max_source_positions * cfg.d_model * 4


def test_greedy_parity_batched(llm, features, prompt, reference):
    # The audio matters: the clips do not all decode alike.
    assert len({tuple(r) for r in reference}) > 1
    outputs = llm.generate([{"prompt_token_ids": prompt, "encoder_inputs": f} for f in features],
                           _params())
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Finished requests leave no encoder state behind.
    assert _slots_in_use(llm.engine) == 0


def test_requests_joining_midway_and_same_prompt_do_not_share_cache(llm, features, prompt,
                                                                    reference):
    """Same decoder prompt for every clip: the prefix cache must not hand one request's
    decoder K/V (which depend on its audio) to another; late joiners see their own audio."""
    engine = llm.engine
    done: dict[str, list[int]] = {}

    def step_until(count: int) -> None:
        for _ in range(count):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids

    engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": features[3]}, _params(),
                       request_id="a")
    step_until(3)
    engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": features[0]}, _params(),
                       request_id="b")
    step_until(2)
    engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": features[2]}, _params(),
                       request_id="c")
    while engine.has_unfinished_requests():
        step_until(1)
    assert done == {"a": reference[3], "b": reference[0], "c": reference[2]}
    assert _slots_in_use(engine) == 0


def test_chunked_prefill_and_preemption(whisper_dir, features, prompt, reference):
    # A 2-token step budget chunks every prompt; 10 blocks of 4 tokens (2 layers x K, V x 64
    # floats each) for 3 sequences of up to 18 tokens (5 blocks each) forces preemption and
    # recompute (a preempted request gives its state slot back: the encoder runs again).
    # The budget holds the 3 state slots first.
    block_bytes = 2 * 2 * 4 * 64 * 4
    llm = cpu_llm(whisper_dir, max_num_batched_tokens=2, block_size=4, max_num_seqs=3,
                  kv_cache_memory=10 * block_bytes + 3 * _slot_bytes(whisper_dir))
    outputs = llm.generate([{"prompt_token_ids": prompt, "encoder_inputs": f}
                            for f in features[:3]], _params())
    assert [o.outputs[0].token_ids for o in outputs] == reference[:3]
    assert llm.engine.scheduler.num_preemptions > 0
    assert _slots_in_use(llm.engine) == 0


def test_abort_frees_encoder_state(llm, features, prompt):
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": features[1]}, _params(),
                       request_id="gone")
    engine.step()
    assert _slots_in_use(engine) == 1
    engine.abort_request("gone")
    assert _slots_in_use(engine) == 0


def test_cross_attention_kv_lives_in_the_state_pool(llm, whisper_dir, features, prompt):
    """The encoder output's K/V are the engine's per-sequence state: one pool tensor pair per
    decoder layer, sized at start-up beside the paged KV (the start-up line names both), a
    slot per running request holding that request's encoder K/V, none left after."""
    from transformers import WhisperConfig

    cfg = WhisperConfig.from_pretrained(whisper_dir)
    engine = llm.engine
    pool = engine.runner.state_pool
    hd = cfg.d_model // cfg.decoder_attention_heads
    assert len(pool.layer_tensors) == cfg.decoder_layers
    for k, v in pool.layer_tensors:
        assert k.shape == v.shape == (8, cfg.decoder_attention_heads,
                                      cfg.max_source_positions, hd)
    assert pool.num_bytes == 8 * _slot_bytes(whisper_dir)
    assert f"state cache: 8 sequence slots x {_slot_bytes(whisper_dir) / 2**10:.1f} KiB" \
        in engine.capacity_message
    for rid, clip in (("x", 2), ("y", 3)):
        engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": features[clip]},
                           _params(), request_id=rid)
    engine.step()
    assert _slots_in_use(engine) == 2
    # Each slot holds its own audio's cross-attention K/V, as transformers computes them.
    ref = WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    with torch.no_grad():
        encoded = ref.model.encoder(features[2:4]).last_hidden_state
    layer = ref.model.decoder.layers[1].encoder_attn
    for row, rid in enumerate(("x", "y")):
        slot = engine.state_slots.slot(rid)
        want_k = layer.k_proj(encoded[row]).view(-1, cfg.decoder_attention_heads, hd)
        want_v = layer.v_proj(encoded[row]).view(-1, cfg.decoder_attention_heads, hd)
        k, v = pool.layer_tensors[1]
        torch.testing.assert_close(k[slot].transpose(0, 1), want_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[slot].transpose(0, 1), want_v, atol=1e-4, rtol=1e-4)
    while engine.has_unfinished_requests():
        engine.step()
    assert _slots_in_use(engine) == 0


def test_admission_waits_for_a_free_state_slot(whisper_dir, features, prompt, reference):
    """Sized from the budget: with the default max_num_seqs, the state pool takes at most half
    the cache budget, here two slots. Four requests: two run, two wait (queued, not refused:
    the scheduler has seats for all) until a slot is given back, and every request still
    decodes its own audio."""
    # Half of it holds 2 slots; the rest ~70 blocks of 16 tokens.
    llm = cpu_llm(whisper_dir, kv_cache_memory=4 * _slot_bytes(whisper_dir) + 200_000)
    engine = llm.engine
    assert engine.state_slots.num_slots == 2
    assert engine.scheduler.config.max_num_seqs > 4
    assert "state cache: 2 sequence slots" in engine.capacity_message
    for i, clip in enumerate(features):
        engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": clip}, _params(),
                           request_id=str(i))
    done: dict[str, list[int]] = {}
    peak, waited = 0, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, _slots_in_use(engine))
        waited |= _slots_in_use(engine) == 2 and engine.scheduler.num_waiting > 0
    assert peak == 2 and waited
    assert done == {str(i): ref for i, ref in enumerate(reference)}
    assert _slots_in_use(engine) == 0


def test_refusals(llm, features, prompt, tmp_path):
    engine = llm.engine
    with pytest.raises(ValueError, match="needs log-mel features"):
        engine.add_request({"prompt_token_ids": prompt}, _params())
    with pytest.raises(ValueError, match=r"features of shape \(80, 1000\)"):
        engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": features[0][:, :100]},
                           _params())
    text = cpu_llm(make_tiny_model(tmp_path / "qwen3"))
    with pytest.raises(ValueError, match="not an encoder-decoder model"):
        text.engine.add_request({"prompt_token_ids": [1, 2], "encoder_inputs": features[0]},
                                _params())


def test_max_model_len_beyond_decoder_positions_is_refused(whisper_dir):
    with pytest.raises(ValueError, match="max_target_positions=128"):
        cpu_llm(whisper_dir, max_model_len=256)


@pytest.mark.parametrize("tied", [True, False])
def test_teacher_forced_logprobs_match_transformers(tmp_path, features, tied):
    """Every position of a longer decoder prompt (forced tokens + text), for two clips in one
    batch with 3-token prefill chunks: the engine's prompt logprobs equal log-softmax of
    transformers' float32 decoder logits on the same features, within 1e-4. ``tied``: the
    head shares the token embedding (as released Whisper checkpoints do)."""
    path = make_tiny_whisper(tmp_path / "w", seed=3, chunk_length=10, tie_word_embeddings=tied)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.convert_tokens_to_ids(PROMPT_TOKENS) + tok.encode(
        " the quick brown fox jumps", add_special_tokens=False)
    model = WhisperForConditionalGeneration.from_pretrained(path).eval()
    clips = features[2:4]
    with torch.no_grad():
        logits = model(input_features=clips,
                       decoder_input_ids=torch.tensor([ids] * len(clips))).logits
    ref = torch.log_softmax(logits.float(), -1)
    assert (ref[0] - ref[1]).abs().max() > 1e-2  # the two clips' audio changes the logits
    llm = cpu_llm(path, max_num_batched_tokens=3, block_size=4)
    outs = llm.generate([{"prompt_token_ids": ids, "encoder_inputs": f} for f in clips],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    for row, out in enumerate(outs):
        got = torch.tensor([out.prompt_logprobs[pos][ids[pos]].logprob
                            for pos in range(1, len(ids))])
        want = ref[row, torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_window_scores_follow_openai_whisper_on_transformers_logits(llm, whisper_dir, features,
                                                                   prompt, reference):
    """verbose_json's per-window ``avg_logprob`` / ``compression_ratio`` from the engine's
    sampled-token logprobs equal openai/whisper's formulas on transformers' float32 logits
    over the same tokens: log-softmax of each sampled token summed through the end token,
    over (tokens before it + 1); zlib ratio of the text without timestamps."""
    import zlib

    from inference_engine.entrypoints.openai.speech_scores import window_scores

    tok = AutoTokenizer.from_pretrained(whisper_dir)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    timestamp_begin = tok.convert_tokens_to_ids("<|0.00|>")
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    outs = llm.generate([{"prompt_token_ids": prompt, "encoder_inputs": f} for f in features],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0,
                                       skip_special_tokens=False))
    ended = 0
    for row, (out, tokens) in enumerate(zip(outs, reference, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        with torch.no_grad():
            logits = model(input_features=features[row : row + 1],
                           decoder_input_ids=torch.tensor([prompt + tokens])).logits[0]
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
        picked = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        n = tokens.index(eot) if eot in tokens else len(tokens)
        ended += eot in tokens
        text = tok.decode([t for t in tokens[:n] if t < timestamp_begin],
                          skip_special_tokens=True).encode()
        got = window_scores(completion.token_ids,
                            [lp[t].logprob for t, lp in zip(tokens, completion.logprobs,
                                                            strict=True)],
                            {eot}, timestamp_begin,
                            lambda ids: tok.decode(ids, skip_special_tokens=True))
        assert got.avg_logprob == pytest.approx(picked[: n + 1].sum().item() / (n + 1),
                                                abs=1e-4)
        assert got.compression_ratio == pytest.approx(len(text) / len(zlib.compress(text)))
    assert ended == 0  # none of these clips ends within MAX_NEW: the sum / (n + 1) case
    # A window that ends: the end token's logprob counts, tokens after it do not, and the
    # divisor is the tokens before it + 1 (openai/whisper's sum_logprobs / (len + 1)).
    ended_scores = window_scores([11, 12, eot, 13], [-1.0, -2.0, -0.5, -9.0], {eot},
                                 timestamp_begin, lambda ids: "ab")
    assert ended_scores.avg_logprob == pytest.approx(-3.5 / 3)
