"""Multi-LoRA throughput: the 64-request workload of offline_throughput.py with 0, 1 and 4
adapters.

Same model and requests as ``bench/offline_throughput.py`` (random Qwen3 shape, hidden 512,
8 layers, bfloat16; 64 requests, prompts 16-512 tokens, 128 output tokens each). Adapters
are random peft adapters of rank 16 on q/k/v/o and gate/up/down. Rows: LoRA off; LoRA on
with no request using an adapter; every request on one adapter; requests spread round-robin
over 4 adapters (``max_loras=4``, so all run in the same steps). Issue 29's target: 4
adapters at most 25 % slower than none, on CPU.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/lora.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from inference_engine import LLM, LoRARequest, SamplingParams
from inference_engine.lora.testing import ALL_TARGETS, make_peft_adapter
from offline_throughput import build_model, workload


def throughput(llm: LLM, prompts: list[list[int]], new_tokens: int,
               loras: list[LoRARequest | None]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    prompts = workload(args.num_requests, torch.Generator().manual_seed(0))
    n = len(prompts)
    with tempfile.TemporaryDirectory() as root:
        base = str(Path(root) / "base")
        print(f"building the model and 4 adapters in {root} ...", flush=True)
        build_model(base, args.layers)
        adapters = [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(
            base, Path(root) / f"a{i}", seed=i, std=0.02, r=args.rank, lora_alpha=args.rank,
            target_modules=ALL_TARGETS))) for i in range(4)]
        results = {}
        plain = LLM(base, dtype="bfloat16", show_progress=False, enable_prefix_caching=False)
        throughput(plain, prompts[:4], 8, [None] * 4)  # warm-up
        results["LoRA off"] = throughput(plain, prompts, args.output_tokens, [None] * n)
        print(f"  LoRA off: {results['LoRA off']:.1f} tok/s", flush=True)
        del plain
        llm = LLM(base, dtype="bfloat16", show_progress=False, enable_prefix_caching=False,
                  enable_lora=True, max_loras=4, max_lora_rank=args.rank)
        throughput(llm, prompts[:4], 8, adapters)  # warm-up, every adapter read once
        cases = {"LoRA on, no adapter used": [None] * n,
                 "1 adapter (all requests)": [adapters[0]] * n,
                 "4 adapters (round-robin)": [adapters[i % 4] for i in range(n)]}
        for name, loras in cases.items():
            results[name] = throughput(llm, prompts, args.output_tokens, loras)
            print(f"  {name}: {results[name]:.1f} tok/s", flush=True)
    base_rate = results["LoRA off"]
    print("\none run each (64 requests x 128 tokens)")
    for name, value in results.items():
        print(f"{name:28s} {value:9.1f} tok/s  {100 * (value / base_rate - 1):+6.1f} %")


if __name__ == "__main__":
    main()
