"""Uploaded audio to mono float32 samples at the model's rate.

``soundfile`` (libsndfile) reads WAV, FLAC, OGG/Vorbis/Opus and MP3 from memory;
channels are averaged to mono and ``soxr`` resamples to the model's rate. Every
failure is an :class:`AudioError` whose message names the problem, for a 400.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

__all__ = ["AudioError", "DecodedAudio", "decode_audio"]


class AudioError(ValueError):
    """An upload that cannot be used as audio (the message says why)."""


@dataclass(frozen=True)
class DecodedAudio:
    """Mono samples at ``sampling_rate`` and what the upload was."""

    # [num_samples] float32 in [-1, 1].
    samples: np.ndarray
    sampling_rate: int
    # The container libsndfile recognised (WAV, FLAC, OGG, MP3...).
    format: str
    # The upload's own rate and channel count, before mixing and resampling.
    source_rate: int
    source_channels: int

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return len(self.samples) / self.sampling_rate


def decode_audio(data: bytes, sampling_rate: int, max_seconds: float | None = None,
                 name: str = "file") -> DecodedAudio:
    """Decode ``data`` (a whole audio file) to mono float32 at ``sampling_rate``.

    Args:
        data: the file's bytes.
        sampling_rate: the rate the model expects.
        max_seconds: refuse longer audio (None: any length).
        name: the upload's field name, for messages.

    Raises:
        AudioError: empty data, a format libsndfile cannot read, no samples, or too long.
    """
    import soundfile
    import soxr

    if not data:
        raise AudioError(f"{name} is empty")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            source_rate, channels, fmt = f.samplerate, f.channels, f.format
            frames = f.frames
            if max_seconds is not None and frames > 0 and frames / source_rate > max_seconds:
                raise AudioError(f"{name} has {frames / source_rate:.1f} s of audio; this "
                                 f"server takes at most {max_seconds:g} s")
            samples = f.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise AudioError(f"{name} is not audio that can be decoded (WAV, FLAC, OGG or MP3 "
                         f"expected): {exc}") from None
    if samples.shape[0] == 0:
        raise AudioError(f"{name} holds no audio samples")
    duration = samples.shape[0] / source_rate
    if max_seconds is not None and duration > max_seconds:  # formats that do not know frames
        raise AudioError(f"{name} has {duration:.1f} s of audio; this server takes at most "
                         f"{max_seconds:g} s")
    mono = samples.mean(axis=1, dtype=np.float32) if channels > 1 else samples[:, 0]
    if source_rate != sampling_rate:
        mono = soxr.resample(mono, source_rate, sampling_rate, quality="HQ")
    return DecodedAudio(np.ascontiguousarray(mono, dtype=np.float32), sampling_rate, fmt,
                        source_rate, channels)
