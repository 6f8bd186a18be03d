"""Transcription throughput of a tiny random Whisper: our server against transformers'
``pipeline("automatic-speech-recognition")`` on the same clips.

The model is ``make_tiny_whisper`` (d_model 64, 2 + 2 layers, 80 mels; its head penalises
special tokens, so both sides decode ``--max-tokens`` text tokens per clip). Ours: the
clips sent at once as WAV uploads to ``/v1/audio/transcriptions`` of a server started here
(decode, windows, features, encoder, paged decoder, all through HTTP). transformers: the
pipeline over the same sample arrays with ``batch_size`` clips per forward. Reported: clips/s
and seconds of audio per second; both sides run in this machine's CPU threads.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/transcription.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import time

import httpx
import numpy as np
from inference_engine.testing import ServerProcess
from inference_engine.testing_audio import make_tiny_whisper, tone, wav_bytes

SR = 16000


def run_server(path: str, uploads: list[bytes], max_tokens: int, threads: int) -> float:
    server = ServerProcess(path, "--max-num-seqs", str(len(uploads)), platform="cpu",
                           threads=threads, kv_cache_memory="64MiB")
    try:
        def one(data: bytes) -> str:
            r = httpx.post(server.url + "/v1/audio/transcriptions", timeout=600,
                           files={"file": ("clip.wav", data)},
                           data={"max_completion_tokens": str(max_tokens), "language": "en"})
            r.raise_for_status()
            return r.json()["text"]

        with concurrent.futures.ThreadPoolExecutor(len(uploads)) as pool:
            list(pool.map(one, uploads[:4]))  # warm-up (kernel builds, first steps)
            start = time.perf_counter()
            texts = list(pool.map(one, uploads))
            elapsed = time.perf_counter() - start
        assert all(texts), "empty transcription"
        return elapsed
    finally:
        server.stop()


def run_pipeline(path: str, audio: list[np.ndarray], max_tokens: int, batch_size: int) -> float:
    from transformers import pipeline

    asr = pipeline("automatic-speech-recognition", model=path, device="cpu")
    kwargs = {"max_new_tokens": max_tokens}
    asr(audio[:4], batch_size=batch_size, generate_kwargs=kwargs)  # warm-up
    start = time.perf_counter()
    out = asr(audio, batch_size=batch_size, generate_kwargs=kwargs)
    elapsed = time.perf_counter() - start
    assert len(out) == len(audio)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' pipeline")
    parser.add_argument("--threads", type=int, default=2, help="server OMP threads")
    args = parser.parse_args()
    import torch

    torch.set_flush_denormal(True)
    audio = [tone(args.seconds, freqs=(200.0 + 13 * i, 900.0 + 7 * i), seed=i, noise=0.05)
             for i in range(args.clips)]
    uploads = [wav_bytes(a, SR) for a in audio]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_whisper(tmp))
        ours = run_server(path, uploads, args.max_tokens, args.threads)
        theirs = run_pipeline(path, audio, args.max_tokens, args.batch_size)
    total = args.clips * args.seconds
    print(f"{args.clips} clips x {args.seconds:g} s, {args.max_tokens} tokens each, tiny Whisper")
    for name, elapsed in (("ours (server, HTTP)", ours),
                          (f"transformers pipeline (batch {args.batch_size})", theirs)):
        print(f"  {name:36s} {args.clips / elapsed:7.2f} clips/s  "
              f"{total / elapsed:7.1f} audio s/s  ({elapsed:.2f} s)")


if __name__ == "__main__":
    main()
