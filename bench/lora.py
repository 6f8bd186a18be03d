"""Multi-LoRA throughput: the 64-request workload of offline_throughput.py with 0, 1 and 4
adapters.

Same model and requests as ``bench/offline_throughput.py`` (random Qwen3 shape, hidden 512,
8 layers, bfloat16; 64 requests, prompts 16-512 tokens, 128 output tokens each). Adapters
are random peft adapters of rank 16 on q/k/v/o and gate/up/down. Rows: LoRA off; LoRA on
with no request using an adapter; every request on one adapter; requests spread round-robin
over 4 adapters (``max_loras=4``, so all run in the same steps). Issue 29's target: 4
adapters at most 25 % slower than none, on CPU. End-to-end rows swing with the machine's
load, so the script also times the linear layers of one 64-token decode step alone: their
base products against the LoRA deltas with 1 and with 4 adapters (best of 30).

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


def linear_cost(llm: LLM, adapters: list[LoRARequest], num_tokens: int,
                reps: int = 30) -> tuple[float, float]:
    """(ms of every LoRA-wrapped linear layer's base product, ms of their deltas) for a
    ``num_tokens``-token decode batch spread round-robin over ``adapters``; the best of
    ``reps`` timings each, so other jobs on the machine matter less than in the end-to-end
    rows."""
    manager = llm.engine.lora
    loaded = [manager.load(r) for r in adapters]
    manager.prepare_step([loaded[i % len(loaded)] for i in range(num_tokens)], [1] * num_tokens)
    layers = [slots.layer for slots in manager.slots.values()]
    inputs = [torch.randn(num_tokens, layer.input_size, dtype=llm.engine.dtype)
              for layer in layers]

    def best(fn) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    with torch.inference_mode():
        outs = [layer.quant_method.apply(layer, x, layer.bias)
                for layer, x in zip(layers, inputs, strict=True)]
        base = best(lambda: [layer.quant_method.apply(layer, x, layer.bias)
                             for layer, x in zip(layers, inputs, strict=True)])
        delta = best(lambda: [layer.lora.add_delta(x, out)
                              for layer, x, out in zip(layers, inputs, outs, strict=True)])
    manager.prepare_step([], [])
    return base, delta


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
        # Warm-up over every prompt: oneDNN builds a GEMM per new row count, once per process,
        # which would otherwise be charged to whichever case ran first.
        throughput(plain, prompts, 4, [None] * n)
        results["LoRA off"] = throughput(plain, prompts, args.output_tokens, [None] * n)
        print(f"  LoRA off: {results['LoRA off']:.1f} tok/s", flush=True)
        del plain
        llm = LLM(base, dtype="bfloat16", show_progress=False, enable_prefix_caching=False,
                  enable_lora=True, max_loras=4, max_lora_rank=args.rank)
        throughput(llm, prompts, 4, [adapters[i % 4] for i in range(n)])  # warm-up
        cases = {"LoRA on, no adapter used": [None] * n,
                 "1 adapter (all requests)": [adapters[0]] * n,
                 "4 adapters (round-robin)": [adapters[i % 4] for i in range(n)]}
        for name, loras in cases.items():
            results[name] = throughput(llm, prompts, args.output_tokens, loras)
            print(f"  {name}: {results[name]:.1f} tok/s", flush=True)
        costs = {k: linear_cost(llm, adapters[:k], args.num_requests) for k in (1, 4)}
    base_rate = results["LoRA off"]
    print(f"\none run each ({n} requests x {args.output_tokens} tokens)")
    for name, value in results.items():
        print(f"{name:28s} {value:9.1f} tok/s  {100 * (value / base_rate - 1):+6.1f} %")
    print(f"\nlinear layers of one {args.num_requests}-token decode step (best of 30):")
    for count, (base_ms, delta_ms) in costs.items():
        print(f"  {count} adapter(s): base products {base_ms:.2f} ms, LoRA deltas "
              f"{delta_ms:.2f} ms (+{100 * delta_ms / base_ms:.1f} %)")


if __name__ == "__main__":
    main()
