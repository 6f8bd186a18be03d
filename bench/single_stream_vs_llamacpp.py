"""CPU single stream vs llama.cpp, and a fresh engine's 64 requests vs transformers.

The issue-33 targets, side by side in one run:

* batch-1 decode tokens/s, ours vs llama.cpp (llama-cpp-python), on the same weights:
  bf16 (an HF folder for ours, llama.cpp's own BF16 conversion of the same F32 GGUF
  for llama.cpp) and Q4_K_M (one file made by llama.cpp's ``llama_model_quantize``,
  read by both). 32-token prompt, 128 greedy tokens, EOS ignored; the two systems
  alternate, each in its own process, medians of ``--repeats``. Ours runs under
  ``OMP_WAIT_POLICY=PASSIVE`` as started; llama.cpp at its defaults (spinning threads);
* with ``--cpu-time``, also both at one thread each (ours in a child process with
  ``OMP_NUM_THREADS=1``, llama.cpp with ``n_threads=1``): the process CPU time per
  decoded token, which other processes on a shared machine barely move (wall-clock
  rates there do, llama.cpp's spinning threads most);
* which path ours ran: multi-step greedy windows of ``--num-scheduler-steps`` tokens per
  C++ call (``engine/multi_step.py``; the engine's default) where the model has one, else
  one engine step per token (the reason is printed);
* the 64-request workload of ``bench/offline_throughput.py`` from a *fresh* engine
  (a new process: ``LLM(...)``, one warm-up request, then the run: what a user who
  starts the engine and submits work sees), against transformers' batched generate
  on the same bf16 folder.

Model: the issue-3 bench architecture (random Qwen3, hidden 512, 8 layers, 8 heads /
4 KV heads, head_dim 64, intermediate 1536, vocab 8192).

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/single_stream_vs_llamacpp.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from gguf.constants import GGMLQuantizationType as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_vs_llamacpp import (  # noqa: E402
    VOCAB,
    build_model,
    find_llamacpp_python,
    q4_k_m,
    run_llamacpp,
)
from inference_engine import LLM, SamplingParams  # noqa: E402
from inference_engine_gguf.export import export_to_gguf  # noqa: E402
from offline_throughput import hf_throughput, ours_throughput, workload  # noqa: E402


def ours_decode_rate(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """Greedy tokens/s of one stream, timed from submission to the last token."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return new_tokens / (time.perf_counter() - start)


def decode_path(llm: LLM) -> str:
    """Which way ``llm`` decodes one greedy stream, and how often windows ran."""
    from inference_engine.layers.cpu_greedy_window import greedy_window_blocker

    engine = llm.engine
    planner = engine.multi_step
    if planner is not None:
        return (f"multi-step windows of up to {planner.num_steps} tokens per C++ call "
                f"({planner.num_windows} windows, {planner.num_window_tokens} tokens so far)")
    steps = engine.config.scheduler.num_scheduler_steps
    why = (greedy_window_blocker(engine.model) if steps > 1
           else "--num-scheduler-steps 1")
    return f"one engine step per token ({why})"


def cpu_time_worker(path: str, dtype: str, prompt_tokens: int, new_tokens: int,
                    num_scheduler_steps: int) -> None:
    """Child process (one thread): ours' process CPU time per decoded token; JSON on stdout."""
    torch.set_flush_denormal(True)
    llm = LLM(path, dtype=dtype, show_progress=False, enable_prefix_caching=False,
              num_scheduler_steps=num_scheduler_steps)
    prompt = {"prompt_token_ids": list(range(5, 5 + prompt_tokens))}

    def cpu(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.process_time()
        llm.generate(prompt, params, use_tqdm=False)
        return time.process_time() - start

    cpu(8)
    runs = [(cpu(new_tokens + 1) - cpu(1)) / new_tokens * 1e3 for _ in range(3)]
    print(json.dumps({"cpu_ms_per_token": statistics.median(runs), "path": decode_path(llm)}))


def cpu_time_run(path: str, dtype: str, prompt_tokens: int, new_tokens: int,
                 num_scheduler_steps: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", INFERENCE_ENGINE_CPU_SPIN_US="0")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--cpu-time-worker", path, dtype,
         "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens),
         "--num-scheduler-steps", str(num_scheduler_steps)],
        capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"CPU-time worker failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  (ours, 1 thread: {result['path']})", flush=True)
    return result["cpu_ms_per_token"]


def fresh_engine_worker(folder: str, num_requests: int, new_tokens: int) -> None:
    """Child process: start an engine, one warm-up request, then the workload; JSON on stdout."""
    torch.set_flush_denormal(True)
    prompts = workload(num_requests, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    llm = LLM(folder, dtype="bfloat16", show_progress=False)
    started = time.perf_counter() - start
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=4),
                 use_tqdm=False)
    cpu = time.process_time()
    rate = ours_throughput(llm, prompts, new_tokens)
    cpu = time.process_time() - cpu  # every thread of this process, over the workload
    print(json.dumps({"start_s": started, "tokens_per_s": rate,
                      "tokens_per_cpu_s": len(prompts) * new_tokens / cpu}))


def fresh_engine_run(folder: str, num_requests: int, new_tokens: int) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--fresh-worker", folder,
         "--num-requests", str(num_requests), "--new-tokens", str(new_tokens)],
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fresh-engine worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=64,
                        help="requests of the fresh-engine workload")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--gguf-dtype", default="float32",
                        help="our compute dtype on the Q4_K_M file")
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--skip-fresh", action="store_true",
                        help="skip the fresh-engine 64-request comparison")
    parser.add_argument("--skip-batch1", action="store_true",
                        help="skip the wall-clock batch-1 comparison")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="ours' multi-step window (1: one step per token); default: the "
                             "engine's")
    parser.add_argument("--cpu-time", action="store_true",
                        help="also compare the CPU time per token at one thread each")
    parser.add_argument("--fresh-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-time-worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fresh_worker:
        fresh_engine_worker(args.fresh_worker, args.num_requests, args.new_tokens)
        return
    if args.num_scheduler_steps is None:
        from inference_engine.config import SchedulerConfig

        args.num_scheduler_steps = SchedulerConfig().num_scheduler_steps
    if args.cpu_time_worker:
        cpu_time_worker(*args.cpu_time_worker, args.prompt_tokens, args.new_tokens,
                        args.num_scheduler_steps)
        return
    torch.set_flush_denormal(True)
    python = find_llamacpp_python(args.llamacpp_python)
    print(f"llama.cpp side: {python or 'SKIPPED (llama-cpp-python not importable)'}")
    results: dict[str, float | str] = {}
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)
        print(f"  {name}: {value:.1f}", flush=True)

    with tempfile.TemporaryDirectory() as work:
        print("building and exporting the model ...", flush=True)
        hf, tokenizer = build_model(args.layers)
        folder = os.path.join(work, "hf-bf16")
        hf.to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        hf.float()
        f32 = os.path.join(work, "model-f32.gguf")
        export_to_gguf(hf, tokenizer, f32, T.F32, extra_control_tokens=VOCAB - len(tokenizer))
        q4 = os.path.join(work, "model-q4_k_m.gguf")
        bf16_gguf = os.path.join(work, "model-bf16.gguf")
        if python is not None:
            for dst, ftype in ((q4, "Q4_K_M"), (bf16_gguf, "BF16")):
                run_llamacpp(python, {"op": "quantize", "src": f32, "dst": dst, "ftype": ftype},
                             work)
        else:
            export_to_gguf(hf, tokenizer, q4, q4_k_m, extra_control_tokens=VOCAB - len(tokenizer))
        del hf
        rng = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, len(tokenizer), (args.prompt_tokens,), generator=rng).tolist()

        files = {"bf16": bf16_gguf, "Q4_K_M": q4}
        if not args.skip_batch1:
            engines = {
                "bf16": LLM(folder, dtype="bfloat16", show_progress=False,
                            enable_prefix_caching=False,
                            num_scheduler_steps=args.num_scheduler_steps),
                "Q4_K_M": LLM(q4, dtype=args.gguf_dtype, show_progress=False,
                              enable_prefix_caching=False,
                              num_scheduler_steps=args.num_scheduler_steps),
            }
            for llm in engines.values():
                ours_decode_rate(llm, prompt, 8)
            for r in range(args.repeats):
                print(f"round {r + 1}/{args.repeats}", flush=True)
                for label, llm in engines.items():
                    record(f"ours batch-1 decode tok/s ({label})",
                           ours_decode_rate(llm, prompt, args.new_tokens))
                    if python is not None:
                        job = {"op": "decode", "model": files[label], "prompt": prompt,
                               "new_tokens": args.new_tokens}
                        record(f"llama.cpp batch-1 decode tok/s ({label})",
                               run_llamacpp(python, job, work, spinning=True)["tokens_per_s"])
            for label, llm in engines.items():
                print(f"  ours ({label}) decoded by {decode_path(llm)}", flush=True)
                results[f"ours path ({label})"] = decode_path(llm)
            del engines
        if args.cpu_time:
            ours_paths = {"bf16": (folder, "bfloat16"), "Q4_K_M": (q4, args.gguf_dtype)}
            for r in range(args.repeats):
                print(f"one-thread CPU time, round {r + 1}/{args.repeats}", flush=True)
                for label, (path, dtype) in ours_paths.items():
                    record(f"ours CPU ms/token, 1 thread ({label})",
                           cpu_time_run(path, dtype, args.prompt_tokens, args.new_tokens,
                                        args.num_scheduler_steps))
                    if python is not None:
                        job = {"op": "decode", "model": files[label],
                               "prompt": list(range(5, 5 + args.prompt_tokens)),
                               "new_tokens": args.new_tokens}
                        os.environ["LLAMACPP_THREADS"] = "1"
                        try:
                            out = run_llamacpp(python, job, work)
                        finally:
                            os.environ.pop("LLAMACPP_THREADS")
                        record(f"llama.cpp CPU ms/token, 1 thread ({label})",
                               out["cpu_ms_per_token"])

        if not args.skip_fresh:
            import transformers

            prompts = workload(args.num_requests, torch.Generator().manual_seed(0))
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.bfloat16).eval()
            hf_throughput(model, prompts[:2], 4, 2)
            for r in range(args.repeats):
                print(f"fresh-engine round {r + 1}/{args.repeats}", flush=True)
                fresh = fresh_engine_run(folder, args.num_requests, args.new_tokens)
                record("ours fresh engine start-up s", fresh["start_s"])
                record(f"ours fresh engine {args.num_requests} requests tok/s",
                       fresh["tokens_per_s"])
                record(f"ours fresh engine {args.num_requests} requests tok per CPU-second",
                       fresh["tokens_per_cpu_s"])
                cpu = time.process_time()
                record(f"transformers {args.num_requests} requests tok/s (batch {args.hf_batch})",
                       hf_throughput(model, prompts, args.new_tokens, args.hf_batch))
                record(f"transformers {args.num_requests} requests tok per CPU-second",
                       len(prompts) * args.new_tokens / (time.process_time() - cpu))

    for name, values in runs.items():
        results[name] = statistics.median(values)
    for label in ("bf16", "Q4_K_M"):
        ours, theirs = (results.get(f"{who} batch-1 decode tok/s ({label})")
                        for who in ("ours", "llama.cpp"))
        if ours and theirs:
            results[f"batch-1 ours / llama.cpp ({label}, target >= 1.0)"] = round(ours / theirs, 3)
        ours, theirs = (results.get(f"{who} CPU ms/token, 1 thread ({label})")
                        for who in ("ours", "llama.cpp"))
        if ours and theirs:
            results[f"1 thread: llama.cpp CPU time / ours ({label})"] = round(theirs / ours, 3)
    if not args.skip_fresh:
        ours = results[f"ours fresh engine {args.num_requests} requests tok/s"]
        hf_rate = results[
            f"transformers {args.num_requests} requests tok/s (batch {args.hf_batch})"]
        results["fresh engine / transformers (target >= 4)"] = round(ours / hf_rate, 2)
        # The same work per second of each process's own CPU time: what the ratio is on a
        # machine nobody else uses, as far as both scale over their threads alike.
        ours = results[f"ours fresh engine {args.num_requests} requests tok per CPU-second"]
        hf_rate = results[f"transformers {args.num_requests} requests tok per CPU-second"]
        results["fresh engine / transformers, per CPU-second"] = round(ours / hf_rate, 2)
    print(f"\nresults (medians of {args.repeats}; OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} for ours)")
    for name, value in results.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {name:56s} {shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
