"""Serving benchmark: N requests at a concurrency (or request rate) against the server.

Prints output throughput, TTFT and inter-token latency (mean, p50, p99). With
``--model`` (default: the small benchmark model of bench/offline_throughput.py,
built in a temp dir) it starts the server itself, runs the load, stops it, then
runs the same work through the offline ``LLM.generate`` with the same number of
sequences in flight, and prints the server's overhead against it.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/serve.py --num-requests 64 --concurrency 32
      .venv/bin/python bench/serve.py --url http://127.0.0.1:8000 --model-name NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import build_model, workload  # noqa: E402


@dataclass
class RequestResult:
    ttft: float = 0.0
    latency: float = 0.0
    # Seconds between consecutive streamed chunks.
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult()
    seen = 0
    start = last = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            result.error = (await r.aread()).decode()
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                break
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
                continue
            if not any(c["text"] for c in chunk["choices"]):
                continue
            # One step adds one token per request, so each text chunk is one token.
            now = time.perf_counter()
            if seen == 0:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            seen += 1
    result.latency = time.perf_counter() - start
    return result


async def run_load(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                   concurrency: int, request_rate: float | None,
                   seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send every prompt, at most ``concurrency`` at once (Poisson arrivals if a rate is set)."""
    semaphore = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    bar = tqdm(total=len(prompts), desc="requests", unit="req", leave=False)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def guarded(prompt: list[int]) -> RequestResult:
            async with semaphore:
                result = await one_request(client, url, model, prompt, max_tokens)
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(guarded(prompt)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    ttfts = sorted(r.ttft for r in ok)
    itls = sorted(x for r in ok for x in r.itls)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok), "seconds": elapsed,
        "output_tok_s": tokens / elapsed, "req_s": len(ok) / elapsed,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_p50_ms": 1e3 * pct(ttfts, 0.5), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
        "itl_mean_ms": 1e3 * statistics.fmean(itls) if itls else float("nan"),
        "itl_p50_ms": 1e3 * pct(itls, 0.5), "itl_p99_ms": 1e3 * pct(itls, 0.99),
    }


def print_summary(name: str, s: dict[str, float]) -> None:
    print(f"{name}: {s['requests']:.0f} requests ({s['failed']:.0f} failed) in "
          f"{s['seconds']:.2f} s: {s['output_tok_s']:.1f} output tok/s, {s['req_s']:.2f} req/s")
    print(f"  TTFT ms  mean {s['ttft_mean_ms']:.1f}  p50 {s['ttft_p50_ms']:.1f}  "
          f"p99 {s['ttft_p99_ms']:.1f}")
    print(f"  ITL  ms  mean {s['itl_mean_ms']:.2f}  p50 {s['itl_p50_ms']:.2f}  "
          f"p99 {s['itl_p99_ms']:.2f}")


def offline_rate(model: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int,
                 kv: int | None) -> float:
    from inference_engine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max_num_seqs, kv_cache_memory=kv, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server; default: start one for --model")
    parser.add_argument("--model", help="model folder to serve (default: the benchmark model)")
    parser.add_argument("--model-name", help="'model' field to send (default: served name)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=None,
                        help="requests/s with Poisson arrivals (default: all at once)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="benchmark model depth")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    parser.add_argument("--repeats", type=int, default=3, help="median over this many runs")
    parser.add_argument("--no-offline", action="store_true", help="skip the LLM.generate run")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    rng = torch.Generator().manual_seed(0)
    prompts = [p[: args.max_prompt_len] for p in workload(args.num_requests, rng)]
    tmp = None
    server = None
    model = args.model
    if args.url is None:
        from inference_engine.testing import ServerProcess

        if model is None:
            tmp = tempfile.TemporaryDirectory()
            model = tmp.name
            print(f"building the benchmark model ({args.layers} layers) in {model}")
            build_model(model, args.layers)
        kv = [] if args.kv_cache_memory is None else ["--kv-cache-memory",
                                                      str(args.kv_cache_memory)]
        server = ServerProcess(model, "--max-num-seqs", str(args.concurrency), *kv,
                               "--log-level", "warning", kv_cache_memory="", threads=None)
        url = server.url
    else:
        url = args.url.rstrip("/")
    name = args.model_name or httpx.get(url + "/v1/models").json()["data"][0]["id"]
    print(f"{len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.max_tokens} output tokens each, concurrency {args.concurrency}"
          + (f", rate {args.request_rate}/s" if args.request_rate else ""))
    try:
        asyncio.run(run_load(url, name, prompts[:4], 4, args.concurrency, None))  # warm-up
        runs = [summarize(*asyncio.run(run_load(url, name, prompts, args.max_tokens,
                                                args.concurrency, args.request_rate)))
                for _ in range(args.repeats)]
    finally:
        if server is not None:
            server.stop()
    best = sorted(runs, key=lambda s: s["output_tok_s"])[len(runs) // 2]
    print_summary("server (median run)", best)
    print("  all runs tok/s: " + ", ".join(f"{s['output_tok_s']:.1f}" for s in runs))
    if server is not None and not args.no_offline:
        rates = [offline_rate(model, prompts, args.max_tokens, args.concurrency,
                              args.kv_cache_memory) for _ in range(args.repeats)]
        offline = statistics.median(rates)
        print(f"offline LLM.generate, same prompts, max_num_seqs={args.concurrency}: "
              f"{offline:.1f} output tok/s (runs: {', '.join(f'{r:.1f}' for r in rates)})")
        overhead = 1 - best["output_tok_s"] / offline
        print(f"server throughput vs offline: {best['output_tok_s'] / offline:.3f}x "
              f"({100 * overhead:+.1f}% overhead; target < 10%)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
