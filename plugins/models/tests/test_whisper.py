"""Whisper in the engine against transformers 5.x on the same log-mel features.

A tiny random WhisperForConditionalGeneration (built and saved here with a
locally trained tokenizer) decodes synthesised audio: the engine's greedy tokens
must equal transformers' greedy ``generate`` (GenerationMixin's, so no
Whisper-specific logits processors) for every clip, whether the requests run
together, join while others decode, are cut into prefill chunks or preempted.
The engine runs on the CPU platform, as the reference does.
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


def test_greedy_parity_batched(llm, features, prompt, reference):
    # The audio matters: the clips do not all decode alike.
    assert len({tuple(r) for r in reference}) > 1
    outputs = llm.generate([{"prompt_token_ids": prompt, "encoder_inputs": f} for f in features],
                           _params())
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Finished requests leave no encoder state behind.
    assert llm.engine.model.num_encoder_states == 0


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
    assert engine.model.num_encoder_states == 0


def test_chunked_prefill_and_preemption(whisper_dir, features, prompt, reference):
    # A 2-token step budget chunks every prompt; 10 blocks of 4 tokens (2 layers x K, V x 64
    # floats each) for 3 sequences of up to 18 tokens (5 blocks each) forces preemption and
    # recompute (the encoder state survives it).
    block_bytes = 2 * 2 * 4 * 64 * 4
    llm = cpu_llm(whisper_dir, max_num_batched_tokens=2, block_size=4,
                  kv_cache_memory=10 * block_bytes)
    outputs = llm.generate([{"prompt_token_ids": prompt, "encoder_inputs": f}
                            for f in features[:3]], _params())
    assert [o.outputs[0].token_ids for o in outputs] == reference[:3]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.model.num_encoder_states == 0


def test_abort_frees_encoder_state(llm, features, prompt):
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt, "encoder_inputs": features[1]}, _params(),
                       request_id="gone")
    engine.step()
    assert engine.model.num_encoder_states == 1
    engine.abort_request("gone")
    assert engine.model.num_encoder_states == 0


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
