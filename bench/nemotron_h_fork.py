"""``n > 1`` on a hybrid model: the prompt computed once and forked vs once per sample, CPU.

Model: bench/nemotron_h.py's bench-sized random Nemotron-H (float32; 3 Mamba-2 layers, MoE,
one attention layer). Workload: one request of ``--prompt-len`` random token ids with
``n`` samples (seeded, temperature 0.8) of ``--new-tokens`` tokens, prefix caching off (it
always is for hybrid models). The same engine runs it with the fork (the default) and with
``engine.fork_prompts = False`` (each sample computes the prompt, as before issue 25's
fork), alternating; the median wall time of ``--repeats`` runs and the prompt tokens the
model computed (``num_prompt_tokens_computed``) are reported, and whether the forked samples'
tokens equal the unforked ones'.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/nemotron_h_fork.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_engine import SamplingParams  # noqa: E402
from inference_engine.testing import cpu_llm  # noqa: E402
from nemotron_h import VOCAB, build  # noqa: E402


def run(llm, prompt: list[int], params: SamplingParams, fork: bool) -> tuple[float, int, list]:
    """(seconds, prompt tokens computed, each sample's tokens) of one request."""
    engine = llm.engine
    engine.fork_prompts = fork
    computed = engine.num_prompt_tokens_computed
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    elapsed = time.perf_counter() - start
    return elapsed, engine.num_prompt_tokens_computed - computed, [
        list(c.token_ids) for c in out.outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory() as path:
        build(path)
        llm = cpu_llm(path, dtype="float32", max_num_seqs=16)
        print(llm.engine.capacity_message)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(1, VOCAB - 1, (args.prompt_len,), generator=gen).tolist()
        for n in args.n:
            params = SamplingParams(n=n, temperature=0.8, seed=3, max_tokens=args.new_tokens,
                                    ignore_eos=True)
            run(llm, prompt, params, True)  # warm-up (oneDNN primitives per shape)
            seconds: dict[bool, list[float]] = {True: [], False: []}
            computed, tokens = {}, {}
            for _ in range(args.repeats):
                for fork in (True, False):
                    elapsed, computed[fork], tokens[fork] = run(llm, prompt, params, fork)
                    seconds[fork].append(elapsed)
            forked, alone = statistics.median(seconds[True]), statistics.median(seconds[False])
            print(f"n={n}, prompt {args.prompt_len}, {args.new_tokens} new tokens: forked "
                  f"{forked:.2f} s ({computed[True]} prompt tokens computed), per sample "
                  f"{alone:.2f} s ({computed[False]}): {alone / forked:.2f}x; same tokens: "
                  f"{tokens[True] == tokens[False]}",
                  {k: [round(v, 2) for v in vs] for k, vs in seconds.items()}, flush=True)


if __name__ == "__main__":
    main()
