"""Test and benchmark helpers for speech: a tiny random Whisper saved with a tokenizer and
feature-extractor config made here (never downloaded), and synthesised audio."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["WHISPER_LANGUAGES", "make_tiny_whisper", "tone", "whisper_tokenizer", "wav_bytes"]

# The language tokens of the tiny tokenizer (a few of Whisper's 99).
WHISPER_LANGUAGES = ["en", "de", "fr", "es", "it", "ja", "zh"]

_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "speech recognition turns audio into text",
    "hello world this is a tiny whisper model",
    "one two three four five six seven eight nine ten",
]


def whisper_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained here, with Whisper's special tokens (start of
    transcript, languages, tasks, no-timestamps, timestamps 0.00..30.00 by 0.02)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TEXTS * 4, trainer)
    specials = (["<|startoftranscript|>"] + [f"<|{lang}|>" for lang in WHISPER_LANGUAGES]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
                   "<|nospeech|>", "<|notimestamps|>"]
                + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    fast = WhisperTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>",
                                bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials})
    return fast


def make_tiny_whisper(path: str | Path, seed: int = 0, num_mel_bins: int = 80,
                      chunk_length: int = 30, **overrides: Any) -> Path:
    """Save a random ``WhisperForConditionalGeneration`` with its tokenizer and
    ``preprocessor_config.json`` under ``path``; returns the path. ``chunk_length``: seconds
    per window (30 as released; shorter windows make the encoder cheaper in tests).

    The decoder head is untied (random tied embeddings make greedy decoding repeat one
    token) and weights are widened so greedy choices are decisive.
    """
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    path = Path(path)
    tokenizer = whisper_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    params: dict[str, Any] = dict(
        vocab_size=len(tokenizer), num_mel_bins=num_mel_bins, d_model=64,
        encoder_layers=2, encoder_attention_heads=4, decoder_layers=2,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=chunk_length * 50, max_target_positions=128, tie_word_embeddings=False,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|endoftext|>"),
        pad_token_id=ids("<|endoftext|>"), decoder_start_token_id=ids("<|startoftranscript|>"),
        suppress_tokens=[], begin_suppress_tokens=[],
    )
    params.update(overrides)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(WhisperConfig(**params)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_positions" not in name:
                p.normal_(0.0, 0.1)
        # Whisper's special tokens (timestamps above all) would win most steps of a random
        # model and decode to no text: one hidden unit is pinned to 1 by the final norm and
        # its column of the head adds +3 to ordinary tokens, -3 to special ones.
        norm = model.model.decoder.layer_norm
        norm.weight[0] = 0.0
        norm.bias[0] = 1.0
        first_special = ids("<|startoftranscript|>")
        model.proj_out.weight[:, 0] = -3.0
        model.proj_out.weight[1:first_special, 0] = 3.0
    model.generation_config.suppress_tokens = None
    model.generation_config.begin_suppress_tokens = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=num_mel_bins,
                            chunk_length=chunk_length).save_pretrained(path)
    return path


def tone(seconds: float, sampling_rate: int = 16000, freqs: tuple[float, ...] = (440.0,),
         seed: int = 0, noise: float = 0.01) -> np.ndarray:
    """Mono float32 sum of sines (changing pitch every half second) plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sampling_rate)) / sampling_rate
    pitch = np.asarray(freqs)[(t * 2).astype(int) % len(freqs)]
    wave = 0.3 * np.sin(2 * np.pi * pitch * t) + noise * rng.standard_normal(len(t))
    return wave.astype(np.float32)


def wav_bytes(samples: np.ndarray, sampling_rate: int = 16000, fmt: str = "WAV",
              subtype: str | None = None) -> bytes:
    """``samples`` (``[n]`` or ``[n, channels]``) written as an in-memory audio file."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, samples, sampling_rate, format=fmt, subtype=subtype)
    return buf.getvalue()
