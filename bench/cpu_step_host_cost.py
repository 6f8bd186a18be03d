"""Host cost of a batch-1 CPU decode step: the bench model's 8 layers with tiny matrices.

The issue-3 bench architecture (Qwen3, 8 layers, 8 heads / 4 KV heads, vocab 8192)
shrunk to hidden 64 / head_dim 8 / intermediate 128, so the kernels' arithmetic is
negligible and what a step costs is getting through it: Python, dispatch, argument
parsing, allocations, scheduling, sampling and output processing. Measured as the
*thread CPU time* of the engine thread per decode step (the difference between
257-token and 1-token requests, over 256 steps), which other processes on a shared
machine do not inflate; run with ``OMP_NUM_THREADS=1`` so every kernel runs on that
thread. The ways of running a step are measured alternately in one process: the C++
decode step (``layers/cpu_decode_step.py``) one engine step per token, the layer loop,
and (per token) multi-step greedy windows of ``--num-scheduler-steps`` tokens per call
(``layers/cpu_greedy_window.py``, ``engine/multi_step.py``).

Run:  OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_step_host_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers
from inference_engine import LLM, SamplingParams
from inference_engine.testing import word_level_tokenizer


def build(path: str, layers: int) -> None:
    config = transformers.Qwen3Config(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=8191, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    word_level_tokenizer(8192).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="K of the multi-step windows measured")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory() as path:
        build(path, args.layers)
        llm = LLM(path, dtype="bfloat16", show_progress=False, enable_prefix_caching=False,
                  platform="cpu", num_scheduler_steps=args.num_scheduler_steps)
        model = llm.engine.model.model
        step = model.decode_step
        windows = llm.engine.multi_step
        prompt = {"prompt_token_ids": list(range(5, 37))}

        def cpu_seconds(tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            start = time.thread_time()
            llm.generate([prompt], params, use_tqdm=False)
            return time.thread_time() - start

        cpu_seconds(8)
        multi = f"windows of {args.num_scheduler_steps} (per token)"
        runs: dict[str, list[float]] = {"C++ decode step": [], "layer loop": [], multi: []}
        for _ in range(args.repeats):
            for name, bound, planner in (("C++ decode step", step, None),
                                         ("layer loop", None, None), (multi, step, windows)):
                if bound is None and name != "layer loop" or (name == multi and windows is None):
                    continue
                model.decode_step = bound
                llm.engine.multi_step = planner
                one = statistics.median(cpu_seconds(1) for _ in range(3))
                runs[name].append((cpu_seconds(257) - one) / 256 * 1e3)
        model.decode_step = step
        llm.engine.multi_step = windows
    print(f"host CPU time per batch-1 decode step (one-step paths) or token (windows), "
          f"{args.layers} layers "
          f"(medians of {args.repeats}):")
    for name, values in runs.items():
        if values:
            print(f"  {name:26s} {statistics.median(values):.3f} ms  "
                  f"(runs: {', '.join(f'{v:.3f}' for v in values)})")
        else:
            print(f"  {name:26s} not available here (see the debug log of layers.cpu_decode_step)")


if __name__ == "__main__":
    main()
