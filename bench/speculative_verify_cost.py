"""Where n-gram speculation loses at batch 4 on CPU (issue 27): the cost of a verify step
and how many steps speculation saves, with the verify attention path A/B in one process.

A verify step runs ``1 + k`` query tokens per request: a short chunk after cached context,
attended like a prefill chunk. On the demo model (head_dim 48) the C++ prefill-attention
kernel had no instance, so those chunks took the torch path: a context gather and an SDPA
call per sequence and layer. The kernel now has head sizes 48 and 96 too; this script
takes 48 out of ``cpu_prefill_kernel._HEAD_SIZES`` for the "before" rows, so both paths
are measured in one process, alternately.

Per case it prints, for plain decoding and for n-gram speculation under each attention
path: engine steps, process CPU ms per step and per output token, and wall tok/s
(median of ``--reps``). Note that plain decoding of the float32 demo model does not use
the C++ whole-step decode either (its weights are not bf16-packed), so both sides run the
layer loop.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/speculative_verify_cost.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import DEMO, REPETITIVE, chat_prompts  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


def measure(llm: Any, prompts: list[str], max_tokens: int, ignore_eos: bool
            ) -> dict[str, float]:
    """Greedy ``prompts`` as one batch, stepped by hand: steps, tokens, CPU and wall."""
    from inference_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps, tokens = 0, 0
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"steps": steps, "tokens": tokens, "cpu_ms_per_step": 1000 * cpu / steps,
            "cpu_ms_per_token": 1000 * cpu / tokens, "tok_s": tokens / wall}


def attention_ab(context: int, reps: int = 300) -> dict[str, float]:
    """Process CPU µs of one layer's verify attention (demo geometry: 4 heads, 2 KV heads,
    head_dim 48, blocks of 16; 4 requests x 5 query tokens after ``context`` cached
    tokens) through each path, alternating in rounds of 50 calls."""
    import math

    import torch
    from inference_engine.builtin.attention import cpu_paged
    from inference_engine.interfaces.attention import AttentionMetadata

    heads, kv_heads, dim, block, n, q = 4, 2, 48, 16, 4, 5
    total = context + q
    per_seq = -(-total // block)
    k_cache = torch.randn(n * per_seq + 1, block, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(1, n * per_seq + 1).view(n, per_seq)
    slots = torch.cat([tables[i, pos // block] * block + pos % block
                       for i in range(n) for pos in [torch.arange(context, total)]])
    backend = cpu_paged.CpuPagedAttentionBackend(heads, dim, kv_heads, 1 / math.sqrt(dim), None)
    query, key = torch.randn(n * q, heads, dim), torch.randn(n * q, kv_heads, dim)

    def metadata() -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=n * q, num_decodes=0, query_start_loc=torch.arange(0, n * q + 1, q),
            seq_lens=torch.full((n,), total), slot_mapping=slots, block_tables=tables,
            block_size=block, query_lens_list=[q] * n, seq_lens_list=[total] * n,
            max_decode_seq_len=0)

    cpu: dict[str, float] = {"gather + SDPA": 0.0, "prefill kernel": 0.0}
    for rnd in range(reps // 50 + 1):  # round 0 warms up
        for name, with_48 in (("gather + SDPA", False), ("prefill kernel", True)):
            _kernel_head_48(with_48)
            start = time.process_time()
            for _ in range(50):
                backend.forward(query, key, key, (k_cache, v_cache), metadata())
            if rnd:
                cpu[name] += time.process_time() - start
    _kernel_head_48(True)
    return {name: 1e6 * t / (reps // 50 * 50) for name, t in cpu.items()}


def _kernel_head_48(enabled: bool) -> None:
    """Give the C++ prefill kernel its head-size-48 instance back, or take it away."""
    from inference_engine.builtin.attention import cpu_prefill_kernel

    sizes = set(cpu_prefill_kernel._HEAD_SIZES) - {48}
    cpu_prefill_kernel._HEAD_SIZES = tuple(sorted(sizes | ({48} if enabled else set())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    import torch
    from inference_engine import LLM

    torch.set_flush_denormal(True)
    kwargs = dict(dtype="float32", kv_cache_memory=1 << 26, platform="cpu",
                  show_progress=False)
    plain = LLM(str(DEMO), **kwargs)
    spec = LLM(str(DEMO), speculative_config=NGRAM, **kwargs)
    # name -> (prompts, ignore_eos)
    cases = {"repetitive text, batch 4": (REPETITIVE, True),
             "demo chats, batch 4 (until EOS)": (chat_prompts(4), False)}
    for context in (64, 400):
        us = attention_ab(context)
        print(f"one layer's verify attention, 4 x 5 queries after {context} tokens: "
              + ", ".join(f"{k} {v:.0f} µs CPU" for k, v in us.items()))
    print(f"{'case':34} {'engine':34} {'steps':>5} {'tokens':>6} {'CPU ms/step':>11} "
          f"{'CPU ms/tok':>10} {'tok/s':>7} {'acc. len':>8}")
    for label, (prompts, ignore_eos) in cases.items():
        runs: dict[str, list[dict[str, float]]] = {}
        accept: dict[str, float] = {}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, llm, with_48 in (("plain", plain, True),
                                       ("ngram k=4, verify via gather + SDPA", spec, False),
                                       ("ngram k=4, verify via prefill kernel", spec, True)):
                _kernel_head_48(with_48)
                m = llm.engine.spec.metrics if llm.engine.spec is not None else None
                before = (m.num_drafts, m.num_accepted_tokens) if m else None
                result = measure(llm, prompts, args.max_tokens if ignore_eos else 256,
                                 ignore_eos)
                if m is not None:
                    drafts = m.num_drafts - before[0]
                    accept[name] = 1 + (m.num_accepted_tokens - before[1]) / max(drafts, 1)
                if rep:
                    runs.setdefault(name, []).append(result)
        _kernel_head_48(True)
        for name, results in runs.items():
            med = {k: statistics.median(r[k] for r in results) for k in results[0]}
            print(f"{label:34} {name:34} {med['steps']:>5.0f} {med['tokens']:>6.0f} "
                  f"{med['cpu_ms_per_step']:>11.2f} {med['cpu_ms_per_token']:>10.3f} "
                  f"{med['tok_s']:>7.1f} {accept.get(name, 1.0):>8.2f}")


if __name__ == "__main__":
    main()
