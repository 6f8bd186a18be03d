"""Whisper feature extraction: our torch pipeline against transformers' WhisperFeatureExtractor.

64 clips of 30 s at 16 kHz (tones plus noise), 80 mel bins, through three extractors in one
run, alternating, several repetitions, median reported:

* ours: :class:`inference_engine.audio.feature_pool.FeaturePool` (the server's path: one
  worker thread per core, two clips per STFT call, batched);
* transformers, numpy: ``WhisperFeatureExtractor(...)`` with torch hidden from it (its numpy
  path: a float64 FFT per clip), the issue's baseline (target: ours >= 2.5x its clips/s);
* transformers, torch: the same extractor with torch available (its batched ``torch.stft``).

Every run checks that the features are identical within 1e-4 (max abs difference printed).

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/audio_features.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import transformers.models.whisper.feature_extraction_whisper as hf_fe
from inference_engine.audio.feature_pool import FeaturePool
from inference_engine.audio.whisper_features import WhisperFeatureConfig, WhisperFeatures
from inference_engine.testing_audio import tone
from transformers import WhisperFeatureExtractor

SR = 16000


def clips(count: int, seconds: float) -> list[np.ndarray]:
    return [tone(seconds, freqs=(200.0 + 37 * i, 1000.0 + 11 * i, 3000.0), seed=i, noise=0.05)
            for i in range(count)]


def hf_numpy(fe: WhisperFeatureExtractor, audio: list[np.ndarray]) -> np.ndarray:
    available = hf_fe.is_torch_available
    hf_fe.is_torch_available = lambda: False
    try:
        return fe(audio, sampling_rate=SR, return_tensors="np").input_features
    finally:
        hf_fe.is_torch_available = available


def hf_torch(fe: WhisperFeatureExtractor, audio: list[np.ndarray]) -> np.ndarray:
    return fe(audio, sampling_rate=SR, return_tensors="np").input_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None,
                        help="feature pool threads (default: one per core)")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    audio = clips(args.clips, args.seconds)
    fe = WhisperFeatureExtractor(feature_size=80)
    pool = FeaturePool(WhisperFeatures(WhisperFeatureConfig()), args.workers)
    systems = {
        "ours (torch, feature pool)": lambda: pool.extract_sync(audio).numpy(),
        "transformers (numpy)": lambda: hf_numpy(fe, audio),
        "transformers (torch)": lambda: hf_torch(fe, audio),
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, np.ndarray] = {}
    for name, fn in systems.items():  # warm-up (FFT plans, thread start)
        outputs[name] = fn()
    for _ in range(args.repeats):
        for name, fn in systems.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    pool.close()
    ours = outputs["ours (torch, feature pool)"]
    print(f"{args.clips} clips x {args.seconds:g} s at {SR} Hz, 80 mel bins; "
          f"{torch.get_num_threads()} torch threads, pool of {pool.num_workers} workers; "
          f"median of {args.repeats}")
    base = args.clips / statistics.median(times["transformers (numpy)"])
    for name, values in times.items():
        rate = args.clips / statistics.median(values)
        diff = float(np.abs(outputs[name] - ours).max())
        print(f"  {name:28s} {rate:8.1f} clips/s  {rate / base:5.2f}x numpy  "
              f"max |diff| vs ours {diff:.2e}")
        assert diff <= 1e-4, f"{name}: features differ by {diff}"


if __name__ == "__main__":
    main()
