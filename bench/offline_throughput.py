"""Offline throughput: this engine vs transformers' batched generate, same work, one run.

Workload (issue 3): a random Qwen3-architecture model (hidden 512, 8 layers,
8 heads / 4 KV heads, intermediate 1536, vocab 8192, bfloat16); 64 requests
with prompt lengths spread over 16-512 tokens and 128 output tokens each
(ignore_eos). Also batch-1 decode tokens/s for both.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/offline_throughput.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import transformers
from inference_engine import LLM, SamplingParams
from inference_engine.testing import word_level_tokenizer


def build_model(path: str, layers: int) -> None:
    config = transformers.Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=8191, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    word_level_tokenizer(8192).save_pretrained(path)


def workload(num_requests: int, rng: torch.Generator) -> list[list[int]]:
    lengths = torch.linspace(16, 512, num_requests).round().long()
    lengths = lengths[torch.randperm(num_requests, generator=rng)]
    return [torch.randint(0, 8191, (int(n),), generator=rng).tolist() for n in lengths]


def hf_throughput(model, prompts: list[list[int]], new_tokens: int, batch: int) -> float:
    """Generated tokens/s of transformers' generate over left-padded batches."""
    total = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0)
        total += (out.shape[1] - width) * len(chunk)
    return total / (time.perf_counter() - start)


def ours_throughput(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def decode_rate_hf(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=0)
    return new_tokens / (time.perf_counter() - start)


def decode_rate_ours(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return new_tokens / (time.perf_counter() - start)


def median_runs(measure: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Run each measurement ``repeats`` times, printing every run; the medians by name."""
    results = {}
    for name, fn in measure.items():
        runs = []
        for r in range(repeats):
            runs.append(fn())
            print(f"  {name} run {r + 1}/{repeats}: {runs[-1]:.1f}", flush=True)
        results[name] = statistics.median(runs)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    rng = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        print(f"building the model in {path} ...", flush=True)
        build_model(path, args.layers)
        prompts = workload(args.num_requests, rng)
        decode_prompt = prompts[0][:32]
        llm = LLM(path, dtype="bfloat16", show_progress=False, enable_prefix_caching=False)
        print(llm.engine.capacity_message)
        hf = None
        if not args.skip_hf:
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        rows = []
        # Warm-up both once on a small slice.
        ours_throughput(llm, prompts[:4], 8)
        measure = {
            "ours 64-request tok/s": lambda: ours_throughput(llm, prompts, args.output_tokens),
            "ours batch-1 decode tok/s": lambda: decode_rate_ours(llm, decode_prompt, args.output_tokens),
        }
        if hf is not None:
            measure["transformers 64-request tok/s"] = lambda: hf_throughput(
                hf, prompts, args.output_tokens, args.hf_batch)
            measure["transformers batch-1 decode tok/s"] = lambda: decode_rate_hf(
                hf, decode_prompt, args.output_tokens)
        results = median_runs(measure, args.repeats)
        print("\nmedian of", args.repeats, "runs")
        for name, value in results.items():
            rows.append(f"{name:38s} {value:9.1f}")
        print("\n".join(rows))
        if hf is not None:
            print(f"throughput ratio ours/transformers: "
                  f"{results['ours 64-request tok/s'] / results['transformers 64-request tok/s']:.2f}x")
            print(f"batch-1 decode ratio ours/transformers: "
                  f"{results['ours batch-1 decode tok/s'] / results['transformers batch-1 decode tok/s']:.2f}x")


if __name__ == "__main__":
    main()
