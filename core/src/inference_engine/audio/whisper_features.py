"""Whisper log-mel features in torch, equal to transformers' ``WhisperFeatureExtractor``.

The recipe is the checkpoint's ``preprocessor_config.json``: a centred STFT
with a periodic Hann window (``n_fft``, ``hop_length``), the power spectrum
minus its last frame, a Slaney mel filter bank of ``feature_size`` bins up to
8 kHz, ``log10`` clamped at 1e-10, a floor 8 below each clip's maximum and
``(x + 4) / 4``. Audio is padded (or cut) to ``chunk_length`` seconds first.

Clips are computed as one batch: one ``torch.stft`` and one matmul for them
all, with no numpy round trips (transformers runs its numpy path clip by clip
in float64).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CLIPS_PER_OP", "WhisperFeatureConfig", "WhisperFeatures", "split_windows"]

# Clips per STFT call: small enough that a step's spectra stay in cache.
CLIPS_PER_OP = 2


@dataclass(frozen=True)
class WhisperFeatureConfig:
    """The feature recipe of a Whisper checkpoint (``preprocessor_config.json``)."""

    # Mel bins (80, or 128 for large-v3).
    feature_size: int = 80
    # Samples per second the model expects.
    sampling_rate: int = 16000
    # STFT hop and window length, in samples.
    hop_length: int = 160
    n_fft: int = 400
    # Seconds per window; audio is padded or cut to this.
    chunk_length: int = 30

    @property
    def n_samples(self) -> int:
        """Samples in one window."""
        return self.chunk_length * self.sampling_rate

    @property
    def num_frames(self) -> int:
        """Feature frames per window (3000 for 30 s)."""
        return self.n_samples // self.hop_length

    @classmethod
    def from_pretrained(cls, path: str) -> WhisperFeatureConfig:
        """Read ``path/preprocessor_config.json``; the defaults where it is absent.

        Raises:
            ValueError: the file is not a JSON object or a value is not a positive int.
        """
        file = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(file):
            return cls()
        with open(file) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{file} is not a JSON object")
        values = {}
        for name in ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length"):
            if name in data:
                value = data[name]
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"{file}: {name} must be a positive integer, got {value!r}")
                values[name] = value
        return cls(**values)


class WhisperFeatures:
    """Computes ``[batch, feature_size, num_frames]`` float32 log-mel features."""

    def __init__(self, config: WhisperFeatureConfig) -> None:
        from transformers.audio_utils import mel_filter_bank

        self.config = config
        # [n_fft // 2 + 1, feature_size], the same bank transformers builds (Slaney).
        filters = mel_filter_bank(
            num_frequency_bins=1 + config.n_fft // 2, num_mel_filters=config.feature_size,
            min_frequency=0.0, max_frequency=8000.0, sampling_rate=config.sampling_rate,
            norm="slaney", mel_scale="slaney")
        # [feature_size, n_freq] contiguous: the matmul's left operand.
        self.filters = torch.from_numpy(np.ascontiguousarray(filters.T)).float()
        self.window = torch.hann_window(config.n_fft)

    def pad(self, clips: list[np.ndarray]) -> torch.Tensor:
        """``[batch, n_samples]`` float32: each clip zero-padded or cut to one window."""
        n = self.config.n_samples
        out = torch.zeros(len(clips), n)
        for i, clip in enumerate(clips):
            samples = torch.from_numpy(np.asarray(clip, dtype=np.float32)[:n])
            out[i, : samples.shape[0]] = samples
        return out

    def __call__(self, clips: list[np.ndarray]) -> torch.Tensor:
        """Features of mono float clips at ``sampling_rate`` (each padded/cut to one window)."""
        return self.from_padded(self.pad(clips))

    def from_padded(self, waveforms: torch.Tensor) -> torch.Tensor:
        """Features of ``[batch, n_samples]`` float32 windows.

        NOTE: computed :data:`CLIPS_PER_OP` clips at a time: the complex spectrum of a
        30 s clip is 4.8 MB, and a whole batch of them (300 MB for 64) leaves the cache
        for every elementwise pass (measured 3x slower on this CPU).
        """
        if waveforms.shape[0] <= CLIPS_PER_OP:
            return self._compute(waveforms)
        return torch.cat([self._compute(part) for part in waveforms.split(CLIPS_PER_OP)])

    def _compute(self, waveforms: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        # stft: [batch, n_freq, frames + 1] complex
        stft = torch.stft(waveforms, cfg.n_fft, cfg.hop_length, window=self.window,
                          return_complex=True)
        # power: [batch, n_freq, frames + 1]; the last frame is dropped after (as transformers)
        power = stft.real.square().add_(stft.imag.square())
        mel = torch.matmul(self.filters, power[..., :-1])
        log_spec = mel.clamp_(min=1e-10).log10_()
        floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0
        log_spec = torch.maximum(log_spec, floor)
        return log_spec.add_(4.0).div_(4.0)


def split_windows(audio: np.ndarray, sampling_rate: int, window_seconds: int = 30,
                  overlap_seconds: float = 1.0) -> list[tuple[int, np.ndarray]]:
    """Cut long audio into windows of at most ``window_seconds``, as vLLM does for Whisper:
    each cut falls at the quietest 100 ms within the last ``overlap_seconds`` of a window,
    so a word is rarely split. Returns ``(start sample, clip)`` per window, in order."""
    window = window_seconds * sampling_rate
    overlap = int(overlap_seconds * sampling_rate)
    quiet = max(1, sampling_rate // 10)
    windows, start = [], 0
    while True:
        if start + window >= len(audio):
            windows.append((start, audio[start:]))
            return windows
        search_from, search_to = start + window - overlap, start + window
        cut, lowest = search_to, float("inf")
        for at in range(search_from, search_to - quiet, quiet):
            energy = float(np.sqrt(np.mean(np.square(audio[at : at + quiet], dtype=np.float64))))
            if energy < lowest:
                lowest, cut = energy, at
        windows.append((start, audio[start:cut]))
        start = cut
