"""Structured outputs: throughput with and without a JSON schema, and compile time per schema.

Workload: the offline benchmark's (bench/offline_throughput.py) random Qwen3 model (hidden
512, 8 layers, vocab 8192, bfloat16) with a byte-level BPE tokenizer of 8192 tokens
trained here (xgrammar needs tokens that spell JSON), 64 requests with prompts of 16-512
tokens and 128 output tokens each (ignore_eos), greedy. Three runs of the same work:

* plain: no constraint;
* one schema: every request constrained by one JSON schema long enough that all 128
  tokens are inside it (an array of 64 {"id", "name"} objects);
* 64 schemas: each request its own random schema (structured_output.random_schemas),
  compiled while the batch runs; tokens after a schema is complete are free (vLLM's rule).

Compile time: each of 64 random schemas compiled alone, cold (no cache), on this thread.
Mask cost per step: 64 matchers filling their bitmask rows, the upload and the masking
of [64, 8192] logits, timed alone (robust where a shared machine makes tok/s noisy).

``--threads 1`` also makes the comparison hold on a shared machine: every run reports
tokens per second of this process's CPU time (all threads: the engine, the grammar
compiler, torch's), which other processes do not change; with one torch thread no worker
spins while it waits.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/structured.py
      OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/structured.py --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
import transformers

from inference_engine import LLM, SamplingParams
from inference_engine.sampling_params import StructuredOutputsParams
from inference_engine.structured_output import GrammarCompilerPool
from inference_engine.structured_output.random_schemas import random_schema
from inference_engine.testing import train_tiny_tokenizer

VOCAB = 8192
LONG_SCHEMA = {"type": "array", "minItems": 64, "maxItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 8}},
    "required": ["id", "name"], "additionalProperties": False}}


def build_model(path: str, layers: int) -> None:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    texts = [" ".join(rng.choice(words) for _ in range(200))
             + f' {{"id": {rng.randint(0, 999)}, "name": "{rng.choice(words)}"}}, [1, 2, 3]'
             for _ in range(500)]
    tokenizer = train_tiny_tokenizer(VOCAB, texts)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def workload(num_requests: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(0)
    lengths = torch.linspace(16, 512, num_requests).round().long()
    lengths = lengths[torch.randperm(num_requests, generator=rng)]
    return [torch.randint(3, VOCAB, (int(n),), generator=rng).tolist() for n in lengths]


def throughput(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
               ) -> tuple[float, float]:
    """(tokens per wall second, tokens per second of this process's CPU time)."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, tokens / cpu


def mask_cost_ms(llm: LLM, rows: int, repeats: int = 50) -> float:
    """Milliseconds per step to fill, upload and apply the bitmask of ``rows`` matchers."""
    from inference_engine.sampling import Sampler, SamplingBatch
    from inference_engine.structured_output import StructuredOutputManager

    engine = llm.engine
    manager = StructuredOutputManager(engine.tokenizer, VOCAB, engine.eos_token_ids)
    constraint = StructuredOutputsParams(json=LONG_SCHEMA, disable_any_whitespace=True)
    ids = [f"bench-{i}" for i in range(rows)]
    for seq_id in ids:
        manager.add(seq_id, constraint, seq_id)
    while manager.num_waiting:
        manager.wait(1.0)
        manager.take_ready()
    for seq_id in ids:  # into the schema: '[{"id": '
        for token in engine.tokenizer.encode('[{"id": ', add_special_tokens=False):
            manager.accept(seq_id, token)
    params = [SamplingParams(temperature=0.0)] * rows
    logits = torch.randn(rows, VOCAB)
    sampler = Sampler(seed=0)
    start = time.perf_counter()
    for _ in range(repeats):
        batch = SamplingBatch.from_rows(params, [[] for _ in ids], VOCAB,
                                        token_bitmask=manager.fill_bitmask(ids))
        sampler.sample_ids(logits, batch)
    masked = (time.perf_counter() - start) / repeats
    plain_batch = SamplingBatch.from_rows(params, [[] for _ in ids], VOCAB)
    start = time.perf_counter()
    for _ in range(repeats):
        sampler.sample_ids(logits, plain_batch)
    return 1e3 * (masked - (time.perf_counter() - start) / repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1: the load-independent CPU-time comparison)")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as path:
        build_model(path, args.layers)
        llm = LLM(path, dtype="bfloat16", show_progress=False, enable_prefix_caching=False)
        prompts = workload(args.num_requests)
        n = len(prompts)
        base = dict(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
        rng = random.Random(1)
        schemas = [random_schema(rng) for _ in range(n)]
        cases = {
            "plain": [SamplingParams(**base)] * n,
            "one schema": [SamplingParams(**base, structured_outputs=StructuredOutputsParams(
                json=LONG_SCHEMA, disable_any_whitespace=True))] * n,
        }
        throughput(llm, prompts[:4], [SamplingParams(**base)] * 4)  # warm-up
        throughput(llm, prompts[:4], cases["one schema"][:4])  # compiles the schema once
        runs: dict[str, list[float]] = {name: [] for name in cases}
        runs["64 schemas (compiled during the run)"] = []
        cpu_runs: dict[str, list[float]] = {name: [] for name in runs}

        def record(name: str, figures: tuple[float, float], r: int) -> None:
            runs[name].append(figures[0])
            cpu_runs[name].append(figures[1])
            print(f"  {name} run {r + 1}: {figures[0]:.1f} tok/s, {figures[1]:.1f} tok per "
                  "CPU-second", flush=True)

        for r in range(args.repeats):  # interleaved, so drift hits every case alike
            for name, params in cases.items():
                record(name, throughput(llm, prompts, params), r)
            # Fresh schemas each run: their compiles are part of the measured time.
            fresh = [dict(s, description=f"run {r}") for s in schemas]
            record("64 schemas (compiled during the run)", throughput(llm, prompts, [
                SamplingParams(**base, structured_outputs=StructuredOutputsParams(json=s))
                for s in fresh]), r)
        (sample,) = llm.generate([{"prompt_token_ids": prompts[0]}], cases["one schema"][:1],
                                 use_tqdm=False)
        print(f"  a constrained output begins: {sample.outputs[0].text[:60]!r}")
        plain = statistics.median(runs["plain"])
        plain_cpu = statistics.median(cpu_runs["plain"])
        print(f"\nmedian of {args.repeats} runs, {n} requests x {args.output_tokens} tokens, "
              f"{torch.get_num_threads()} torch thread(s)")
        for name, values in runs.items():
            median, cpu = statistics.median(values), statistics.median(cpu_runs[name])
            print(f"{name:40s} {median:8.1f} tok/s  ({median / plain - 1:+.1%} vs plain)   "
                  f"{cpu:8.1f} tok/CPU-s ({cpu / plain_cpu - 1:+.1%})")

        pool = GrammarCompilerPool(llm.get_tokenizer(), VOCAB, llm.engine.eos_token_ids)
        times = [pool.compile(StructuredOutputsParams(json=s)).compile_seconds * 1e3
                 for s in schemas]
        long_ms = pool.compile(StructuredOutputsParams(json=LONG_SCHEMA)).compile_seconds * 1e3
        pool.close()
        print(f"compile per random schema (ms): median {statistics.median(times):.1f}, "
              f"max {max(times):.1f}, min {min(times):.1f}; the long schema: {long_ms:.1f}")
        mask_ms = mask_cost_ms(llm, n)
        step_ms = 1e3 * n / plain  # a full-batch decode step at the plain throughput
        print(f"mask cost per step, {n} rows: {mask_ms:.2f} ms (plain step ~{step_ms:.0f} ms, "
              f"{mask_ms / step_ms:.1%})")


if __name__ == "__main__":
    main()
