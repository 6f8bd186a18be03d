"""Profile the engine on the benchmark model: where a decode step's time goes.

Run: OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/profile_step.py [--batch N]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from inference_engine import LLM, SamplingParams

from offline_throughput import build_model  # noqa: E402  (run from bench/ or with it on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        build_model(path, 8)
        llm = LLM(path, dtype="bfloat16", show_progress=False, enable_prefix_caching=False)
        prompts = [{"prompt_token_ids": list(range(i, i + args.prompt_len))} for i in range(args.batch)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
