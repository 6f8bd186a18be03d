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


def run(llm: LLM, work: DeviceWork, mode: str, count: int, tokens: int) -> list[float]:
    """Host ms of each steady decode step of ``count`` requests of ``tokens`` tokens.

    A steady decode step is one where every request runs and has sampled already (no
    prefill in it) and none ends (the last step, which reports every request, is left
    out): the per-step median of these is robust to a noisy machine's spikes, which a
    difference of whole-run totals is not.
    """
    engine = llm.engine
    kind = RequestOutputKind.DELTA if mode == "stream" else RequestOutputKind.FINAL_ONLY
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=kind)
    for ids in prompts(count):
        engine.add_request({"prompt_token_ids": ids}, params, final_only=mode == "final")
    host: list[float] = []
    running = engine.scheduler.running
    while engine.has_unfinished_requests():
        steady = (len(running) == count
                  and all(r.output_token_ids or r.num_pending_tokens for r in running))
        work.seconds = 0.0
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        if steady and engine.has_unfinished_requests():
            host.append((wall - work.seconds) * 1e3)
    return host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=65, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule step N+1 before reading step N back (a GPU's default)")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory() as path:
        build(path, 8)
        llm = LLM(path, dtype="bfloat16", show_progress=False, enable_prefix_caching=False,
                  platform="cpu", max_num_seqs=max(args.requests), num_scheduler_steps=1,
                  async_scheduling=args.async_scheduling)
        work = DeviceWork(llm)
        run(llm, work, "final", 8, 4)  # warm-up
        print(f"host ms per steady decode step (step wall minus forward, LM head and "
              f"sampler; {args.tokens} tokens per request; median of {args.repeats} runs' "
              f"per-step medians)")
        for count in args.requests:
            for mode in ("final", "stream"):
                medians = [statistics.median(run(llm, work, mode, count, args.tokens))
                           for _ in range(args.repeats)]
                middle = statistics.median(medians)
                print(f"  {count:4d} requests, {mode:6s}: host {middle:6.3f} ms per step "
                      f"(medians of the runs: {', '.join(f'{v:.3f}' for v in medians)})")


if __name__ == "__main__":
    main()
