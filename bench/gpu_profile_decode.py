"""Where a batch-1 decode token's time goes on the GPU: device kernels against wall time.

The GPU-engine issue's batch-1 target is 70 % of the HBM limit; the first H200 run reached 34 %
(1.52 ms per token where 0.52 ms is the weight read). This answers why, in one run, for the next
session with a GPU:

- **eager**: one request decoding ``--tokens`` tokens under ``torch.profiler``; per token, the
  number of device kernels launched, their summed device time, and the top kernels by device time
  (with launches per token and, for the GEMMs, the bandwidth of reading their weights);
- **graphs**: the same decode replayed from CUDA graphs: wall time per token against the summed
  device time (what is left is launch gaps and host work between graph replays).

If the device time per token is near the wall time, kernel efficiency (the GEMVs) is the limit;
if it is well under it, the gaps are. Prints one JSON object (``--out`` writes it too).

Run on the GPU machine (a step of bench/gpu_check.sh):
    python bench/gpu_profile_decode.py --out /tmp/gpu_profile.json
On a CPU it runs too (``--device cpu --layers 2``: CPU ops in place of kernels), which is how
the script itself is tested.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import build_model  # noqa: E402
from inference_engine import LLM, SamplingParams  # noqa: E402

# Substrings of GEMM/GEMV kernel names (cuBLAS, cuBLASLt, CUTLASS, nvjet) and of CPU matmuls.
GEMM_MARKERS = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "sm90_", "addmm", "aten::mm",
                "aten::linear", "gemv_packed", "gemm_packed")


def device_time_us(event: Any, on_gpu: bool) -> float:
    """An averaged profiler event's total time on the device (the CPU for CPU runs), in µs."""
    if not on_gpu:
        return float(event.self_cpu_time_total)
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def decode(llm: LLM, prompt: list[int], tokens: int) -> None:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)


def profile_eager(llm: LLM, prompt: list[int], tokens: int, weight_bytes: int,
                  on_gpu: bool, top: int) -> dict[str, Any]:
    """Kernels per decode token and where their device time goes (prefill subtracted)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])

    def summary(n: int) -> dict[str, tuple[int, float]]:
        with profile(activities=activities) as prof:
            decode(llm, prompt, n)
            if on_gpu:
                torch.cuda.synchronize()
        out = {}
        for event in prof.key_averages():
            us = device_time_us(event, on_gpu)
            if on_gpu and event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            if not on_gpu and not event.key.startswith(("aten::", "inference_engine")):
                continue
            out[event.key] = (event.count, us)
        return out

    one, full = summary(1), summary(1 + tokens)
    # Per decode token: (1 + N tokens) minus (1 token), divided by N.
    rows = []
    for key, (count, us) in full.items():
        base_count, base_us = one.get(key, (0, 0.0))
        calls, time_us = (count - base_count) / tokens, (us - base_us) / tokens
        if calls > 0 or time_us > 0:
            rows.append((key, calls, time_us))
    rows.sort(key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    gemm_us = sum(r[2] for r in rows if any(m in r[0].lower() for m in GEMM_MARKERS))
    gemm_gb_s = round(weight_bytes / (gemm_us * 1e-6) / 1e9, 1) if gemm_us else None
    return {
        "kernels_per_token": round(sum(r[1] for r in rows), 1),
        "device_us_per_token": round(total_us, 1),
        "gemm_us_per_token": round(gemm_us, 1),
        # All weights are read once per token: their bytes over the GEMMs' time.
        "gemm_weight_read_gb_s": gemm_gb_s,
        "top": [{"kernel": k[:120], "per_token": round(c, 2), "us_per_token": round(t, 1),
                 "share": round(t / total_us, 3) if total_us else None}
                for k, c, t in rows[:top]],
    }


def wall_us_per_token(llm: LLM, prompt: list[int], tokens: int, sync: Any) -> float:
    """Decode-only wall time per token: median of 3 of time(1 + N) - time(1), over N."""

    def timed(n: int) -> float:
        sync()
        start = time.perf_counter()
        decode(llm, prompt, n)
        sync()
        return time.perf_counter() - start

    one = statistics.median(timed(1) for _ in range(3))
    full = statistics.median(timed(1 + tokens) for _ in range(3))
    return (full - one) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens profiled")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    on_gpu = args.device != "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if on_gpu else "cpu"}
    with tempfile.TemporaryDirectory() as path:
        weight_bytes = build_model(path, args.device, args.layers)
        result["weight_bytes"] = weight_bytes
        prompt = list(range(1, 33))
        kwargs: dict[str, Any] = dict(dtype="bfloat16", show_progress=False, max_model_len=1024,
                                      enable_prefix_caching=False)
        if on_gpu:
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        else:
            kwargs["platform"] = "cpu"
        for mode, eager in (("eager", True), ("graphs", False)):
            if mode == "graphs" and not on_gpu:
                continue  # no graphs on a CPU
            llm = LLM(path, enforce_eager=eager, **kwargs)
            decode(llm, prompt, 4)  # warm-up: kernels compiled, graphs captured
            wall = wall_us_per_token(llm, prompt, args.tokens, sync)
            entry = profile_eager(llm, prompt, args.tokens, weight_bytes, on_gpu, args.top)
            entry["wall_us_per_token"] = round(wall, 1)
            entry["device_busy_fraction"] = round(entry["device_us_per_token"] / wall, 3)
            entry["graphs"] = llm.engine.graphs_message
            result[mode] = entry
            del llm
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
