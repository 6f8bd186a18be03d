"""One greedy stream's cost per token against ``--num-scheduler-steps`` (the window K).

The issue-3 bench model (random Qwen3, hidden 512, 8 layers, vocab 8192) as a bf16 folder,
one engine per K, 32-token prompt, the difference between 129- and 1-token requests over
128 tokens: process CPU time (which other processes on a shared machine barely move) and
wall time per token, medians of ``--repeats``. K = 1 is the one-step path. Run with
``OMP_NUM_THREADS=1`` for one thread (the figure the default K was chosen on).

Run:  OMP_NUM_THREADS=1 .venv/bin/python bench/multi_step_window_sweep.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_vs_llamacpp import build_model  # noqa: E402
from inference_engine import LLM, SamplingParams  # noqa: E402


def per_token_ms(llm: LLM, prompt: dict, new_tokens: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per token of one greedy stream."""

    def run(tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        cpu, wall = time.process_time(), time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.process_time() - cpu, time.perf_counter() - wall

    (cpu_n, wall_n), (cpu_1, wall_1) = run(new_tokens + 1), run(1)
    return (cpu_n - cpu_1) / new_tokens * 1e3, (wall_n - wall_1) / new_tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    prompt = {"prompt_token_ids": list(range(5, 37))}
    with tempfile.TemporaryDirectory() as folder:
        hf, tokenizer = build_model(args.layers)
        hf.to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del hf
        print(f"threads {torch.get_num_threads()}; per token, medians of {args.repeats}")
        for k in args.steps:
            llm = LLM(folder, dtype="bfloat16", show_progress=False,
                      enable_prefix_caching=False, num_scheduler_steps=k)
            per_token_ms(llm, prompt, 8)
            runs = [per_token_ms(llm, prompt, args.new_tokens) for _ in range(args.repeats)]
            planner = llm.engine.multi_step
            path = (f"{planner.num_windows} windows" if planner is not None
                    else "one step per token")
            print(f"  K={k:3d}  CPU {statistics.median(r[0] for r in runs):.3f} ms  "
                  f"wall {statistics.median(r[1] for r in runs):.3f} ms  ({path})", flush=True)
            del llm


if __name__ == "__main__":
    main()
