"""Audio input: decoding uploads (formats, mono mix, resampling, refusals), Whisper log-mel
features against transformers' WhisperFeatureExtractor, the batching pool, long-audio windows
and the timestamp/subtitle formatting."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import transformers.models.whisper.feature_extraction_whisper as hf_whisper_fe
from inference_engine.audio.decode import AudioError, decode_audio
from inference_engine.audio.feature_pool import FeaturePool
from inference_engine.audio.whisper_features import (
    WhisperFeatureConfig,
    WhisperFeatures,
    split_windows,
)
from inference_engine.entrypoints.openai.speech_format import parse_segments, to_srt, to_vtt
from inference_engine.testing_audio import tone, wav_bytes
from transformers import WhisperFeatureExtractor

SR = 16000
# The bound on |ours - WhisperFeatureExtractor|.
FEATURE_TOLERANCE = 1e-4


def _hf_numpy(fe: WhisperFeatureExtractor, clips: list[np.ndarray],
              monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """transformers' numpy path (what it runs without torch: float64 FFT per clip)."""
    with monkeypatch.context() as m:
        m.setattr(hf_whisper_fe, "is_torch_available", lambda: False)
        return fe(clips, sampling_rate=SR, return_tensors="np").input_features


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        tone(2.5, freqs=(220.0, 880.0)),
        (0.4 * rng.standard_normal(SR * 7)).astype(np.float32),
        np.zeros(SR, dtype=np.float32),  # silence: every bin at the floor
        tone(31.0, freqs=(300.0, 3000.0, 7000.0), noise=0.05),  # cut to 30 s
        tone(0.01),  # a few samples
    ]


@pytest.mark.parametrize("feature_size", [80, 128])
def test_features_equal_whisper_feature_extractor(clips, feature_size, monkeypatch):
    fe = WhisperFeatureExtractor(feature_size=feature_size)
    ours = WhisperFeatures(WhisperFeatureConfig(feature_size=feature_size))(clips).numpy()
    hf_torch = fe(clips, sampling_rate=SR, return_tensors="np").input_features
    hf_numpy = _hf_numpy(fe, clips, monkeypatch)
    assert ours.shape == hf_numpy.shape == (len(clips), feature_size, 3000)
    assert np.abs(ours - hf_numpy).max() <= FEATURE_TOLERANCE
    assert np.abs(ours - hf_torch).max() <= FEATURE_TOLERANCE


def test_feature_config_from_preprocessor_config(tmp_path):
    WhisperFeatureExtractor(feature_size=128, hop_length=160, chunk_length=30).save_pretrained(
        tmp_path)
    config = WhisperFeatureConfig.from_pretrained(str(tmp_path))
    assert (config.feature_size, config.num_frames, config.n_samples) == (128, 3000, 480000)
    (tmp_path / "preprocessor_config.json").write_text('{"feature_size": "eighty"}')
    with pytest.raises(ValueError, match="feature_size must be a positive integer"):
        WhisperFeatureConfig.from_pretrained(str(tmp_path))


def test_pool_batches_requests_and_matches_direct(clips):
    features = WhisperFeatures(WhisperFeatureConfig())
    pool = FeaturePool(features, num_workers=2)
    try:
        async def run():
            # Three requests queued in one loop turn: one batch for them all.
            return await asyncio.gather(pool.extract(clips[:2]), pool.extract(clips[2:3]),
                                        pool.extract(clips[3:]))
        results = asyncio.run(run())
        assert pool.num_batches == 1 and pool.num_clips == len(clips)
        direct = features(clips)
        torch.testing.assert_close(torch.cat(results), direct, rtol=0, atol=0)
        torch.testing.assert_close(pool.extract_sync(clips), direct, rtol=0, atol=0)
    finally:
        pool.close()


def test_split_windows_cuts_long_audio_at_the_quiet_point():
    audio = tone(70.0, noise=0.0)
    quiet_at = 29 * SR + SR // 2  # a silent 100 ms inside the first window's last second
    audio[quiet_at : quiet_at + SR // 10] = 0.0
    windows = split_windows(audio, SR)
    starts = [start for start, _ in windows]
    assert starts[1] == quiet_at
    assert all(len(clip) <= 30 * SR for _, clip in windows)
    np.testing.assert_array_equal(np.concatenate([clip for _, clip in windows]), audio)
    assert split_windows(tone(12.0), SR)[0][0] == 0 and len(split_windows(tone(12.0), SR)) == 1


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"),
                                         ("MP3", None)])
def test_decode_formats_mix_to_mono_and_resample(fmt, subtype):
    rate = 44100
    t = np.arange(int(1.5 * rate)) / rate
    left = 0.4 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([left, left * 0.5], axis=1)  # mono mix: 0.75 x the left channel
    audio = decode_audio(wav_bytes(stereo, rate, fmt, subtype), SR)
    assert audio.sampling_rate == SR and audio.source_rate == rate
    assert audio.source_channels == 2 and audio.format == fmt
    assert abs(audio.duration - 1.5) < 0.06  # MP3 frames pad a little
    # Reference: the same tone synthesised at 16 kHz, compared by spectrum peak and level.
    spectrum = np.abs(np.fft.rfft(audio.samples))
    peak_hz = np.argmax(spectrum) * SR / len(audio.samples)
    assert abs(peak_hz - 440) < 2
    middle = audio.samples[SR // 4 : -SR // 4]
    rms_expected = 0.75 * 0.4 / np.sqrt(2)
    assert abs(np.sqrt(np.mean(middle**2)) - rms_expected) < 0.01


def test_decode_exact_wav_passthrough():
    samples = tone(1.0)
    audio = decode_audio(wav_bytes(samples, SR, "WAV", "FLOAT"), SR)
    np.testing.assert_array_equal(audio.samples, samples)


def test_decode_refusals_name_the_problem():
    with pytest.raises(AudioError, match="file is empty"):
        decode_audio(b"", SR)
    with pytest.raises(AudioError, match="not audio that can be decoded"):
        decode_audio(b"%PDF-1.4 this is not audio", SR)
    with pytest.raises(AudioError, match="holds no audio samples"):
        decode_audio(wav_bytes(np.zeros(0, dtype=np.float32)), SR)
    with pytest.raises(AudioError, match=r"has 5.0 s of audio; this server takes at most 4 s"):
        decode_audio(wav_bytes(tone(5.0)), SR, max_seconds=4)


def test_segments_from_timestamp_tokens_and_subtitles():
    ts = 1000  # id of <|0.00|>
    words = {1: "hello", 2: " world", 3: " again"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    # <|0.00|> hello world <|1.50|><|1.50|> again  (no closing stamp: ends at the window)
    tokens = [ts, 1, 2, ts + 75, ts + 75, 3, 0]
    segments = parse_segments(tokens, ts, {0}, offset=30.0, window_end=42.0, seek=3000,
                              decode=decode)
    assert [(s.start, s.end, s.text) for s in segments] == [
        (30.0, 31.5, "hello world"), (31.5, 42.0, " again")]
    assert to_srt(segments) == ("1\n00:00:30,000 --> 00:00:31,500\nhello world\n\n"
                                "2\n00:00:31,500 --> 00:00:42,000\nagain\n")
    assert to_vtt(segments).startswith("WEBVTT\n\n00:00:30.000 --> 00:00:31.500\nhello world")
    # No timestamps at all: one segment over the window.
    only_text = parse_segments([1, 2], ts, {0}, 0.0, 12.5, 0, decode)
    assert [(s.start, s.end) for s in only_text] == [(0.0, 12.5)]
