"""Host time of a decode step at high concurrency: everything the engine does besides the model.

At 256 running requests a GPU decode step of the GPU-engine issue's bench model is a few
milliseconds of device time; with async scheduling the host prepares step N+1 while step N
runs, so the step is host-bound once the host's share (scheduling, input fill, output
processing, stop checks, outputs) is longer than the device's. That share is the same
Python on any platform, so it is measured here on the CPU: the issue-3 bench architecture
shrunk to tiny matrices (``cpu_step_host_cost.build``), N requests decoding together, and
per decode step the wall time of ``LLMEngine.step`` minus the time inside the model's
forward, its LM head and the sampler (each timed by a wrapper). Two ways of asking:

* ``final``: ``LLM.generate`` (each request reported once, at its end; its text decoded then);
* ``stream``: every request streaming deltas, as the OpenAI server asks (each step
  detokenizes a token per request and builds a RequestOutput per request).

Run:  OMP_NUM_THREADS=1 .venv/bin/python bench/host_cost_at_concurrency.py [--requests 64 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_step_host_cost import build  # noqa: E402
from inference_engine import LLM, SamplingParams  # noqa: E402
from inference_engine.sampling_params import RequestOutputKind  # noqa: E402


class DeviceWork:
    """Seconds spent in the model's forward, its LM head and the sampler."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        engine = llm.engine
        model = engine.runner.model
        model.forward = self._timed(model.forward)
        model.compute_logits = self._timed(model.compute_logits)
        engine.sampler = self._timed(engine.sampler)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call


def prompts(count: int) -> list[list[int]]:
    """``count`` distinct prompts of 16-47 tokens."""
    return [[5 + (i * 7 + j) % 8000 for j in range(16 + i % 32)] for i in range(count)]


def run(llm: LLM, work: DeviceWork, mode: str, count: int, tokens: int) -> tuple[float, float, int]:
    """(wall seconds, device-work seconds, engine steps) of ``count`` requests of ``tokens``."""
    engine = llm.engine
    kind = RequestOutputKind.DELTA if mode == "stream" else RequestOutputKind.FINAL_ONLY
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=kind)
    for ids in prompts(count):
        engine.add_request({"prompt_token_ids": ids}, params, final_only=mode == "final")
    work.seconds = 0.0
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - start, work.seconds, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=65,
                        help="output tokens per request (the 1-token run is subtracted)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory() as path:
        build(path, 8)
        llm = LLM(path, dtype="bfloat16", show_progress=False, enable_prefix_caching=False,
                  platform="cpu", max_num_seqs=max(args.requests), num_scheduler_steps=1)
        work = DeviceWork(llm)
        run(llm, work, "final", 8, 4)  # warm-up
        print(f"host ms per decode step (step wall minus forward, LM head and sampler; "
              f"{args.tokens - 1} decode steps; medians of {args.repeats})")
        for count in args.requests:
            for mode in ("final", "stream"):
                host, total = [], []
                for _ in range(args.repeats):
                    w1, d1, s1 = run(llm, work, mode, count, 1)
                    w2, d2, s2 = run(llm, work, mode, count, args.tokens)
                    steps = s2 - s1
                    host.append(((w2 - d2) - (w1 - d1)) / steps * 1e3)
                    total.append((w2 - w1) / steps * 1e3)
                print(f"  {count:4d} requests, {mode:6s}: host {statistics.median(host):6.3f} ms "
                      f"(runs {', '.join(f'{v:.3f}' for v in host)}); whole step "
                      f"{statistics.median(total):.3f} ms")


if __name__ == "__main__":
    main()
