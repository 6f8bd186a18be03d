"""Sweep launch configs of the quantized kernels on the GPU; write the tables the quant plugin
answers ``ie_kernel_tuning_config`` from (``inference_engine_quant/tuning_tables.py``).

Ops and shapes (weight shapes of the GPU bench model and of a 64-expert MoE, M in
power-of-two buckets: the tables hold buckets, never every M):

* ``fp8_block_gemm`` (128x128 block FP8, FP8 activations) and ``fp4_gemm``
  (MXFP4 weight-only): N x K in 4096x2048 (qkv), 2048x2048 (o), 12288x2048
  (gate_up), 2048x6144 (down), 4096x4096; M buckets 1, 16, 64, 256, 1024, 4096;
* ``fused_moe_fp8`` / ``fused_moe_mxfp4``: E 64, top-8, hidden 2048, intermediate
  768 (both GEMMs), T buckets 1, 16, 64, 256.

Every candidate is checked against the kernel's default output (same numbers, within
1e-2 relative) before it may win. Each (op, shape, bucket) entry records the best
config, its time and the default's (``triton.testing.do_bench``, median ms). Stops
sweeping at ``--budget-s`` and writes what it measured (``"complete": false``).

Run on the GPU (a step of bench/gpu_check.sh):
    python bench/tune_gpu_kernels.py --out-dir $OUT/tuning_tables --budget-s 150
then review and copy ``<arch>/*.json`` into
``plugins/quant/src/inference_engine_quant/tuning_tables/``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch

GEMM_SHAPES = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (4096, 4096)]
GEMM_BUCKETS = [1, 16, 64, 256, 1024, 4096]
MOE = {"E": 64, "topk": 8, "hidden": 2048, "inter": 768}
MOE_BUCKETS = [1, 16, 64, 256]


def gemm_candidates(m: int, fp8: bool) -> list[dict[str, Any]]:
    """A small grid: thin tiles and split-K for decode sizes, big tiles for prefill."""
    out = []
    if m <= 64:
        for bm, bn, split, warps in itertools.product(
                [16] if m <= 16 else [16, 64], [32, 64, 128], [1, 2, 4, 8], [4]):
            out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": 128,
                        "SPLIT_K": split, "GROUP_SIZE_M": 1, "num_warps": warps,
                        "num_stages": 4 if fp8 else 3})
    else:
        for bm, bn, warps, stages in itertools.product([64, 128], [128, 256], [4, 8], [3, 4]):
            out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": 128 if fp8 else 64,
                        "SPLIT_K": 1, "GROUP_SIZE_M": 8, "num_warps": warps,
                        "num_stages": stages})
    return out


def moe_candidates(t: int) -> list[dict[str, Any]]:
    out = []
    small = t * MOE["topk"] <= MOE["E"] * 4
    for bm, bn, warps in itertools.product([16, 32] if small else [32, 64],
                                           [32, 64, 128], [4, 8]):
        out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": 128,
                    "GROUP_SIZE_M": 1 if small else 8, "num_warps": warps, "num_stages": 3})
    return out


class Sweep:
    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.complete = True

    def over(self) -> bool:
        if time.monotonic() > self.deadline:
            self.complete = False
        return not self.complete

    def best(self, run: Any, candidates: list[dict[str, Any]], default: dict[str, Any]
             ) -> dict[str, Any] | None:
        """Time ``run(config)`` for the default and each candidate that gives its numbers."""
        from triton.testing import do_bench

        ref = run(default).float()
        default_ms = do_bench(lambda: run(default), warmup=5, rep=20)
        best_cfg, best_ms = default, default_ms
        for cfg in candidates:
            if self.over():
                break
            try:
                got = run(cfg).float()
            except Exception:  # noqa: BLE001 - a config the compiler rejects (shared memory)
                continue
            scale = ref.abs().max().clamp_min(1e-6)
            if ((got - ref).abs().max() / scale) > 1e-2:
                continue
            ms = do_bench(lambda c=cfg: run(c), warmup=5, rep=20)
            if ms < best_ms:
                best_cfg, best_ms = cfg, ms
        return {"config": best_cfg, "ms": round(best_ms, 5), "default_ms": round(default_ms, 5)}


def tune_gemms(sweep: Sweep, tables: dict[str, list[dict[str, Any]]]) -> None:
    from inference_engine_quant.fp8_math import quantize_activation, quantize_weight_blockwise
    from inference_engine_quant.kernels.fp4_gemm import DEFAULT_CONFIG as FP4_DEFAULT
    from inference_engine_quant.kernels.fp4_gemm import fp4_linear_triton
    from inference_engine_quant.kernels.fp8_block_gemm import DEFAULT_CONFIG as FP8_DEFAULT
    from inference_engine_quant.kernels.fp8_block_gemm import fp8_block_gemm
    from inference_engine_quant.mx_block import quantize_mxfp4

    dev = "cuda"
    for n, k in GEMM_SHAPES:
        w = torch.randn(n, k, device=dev) * 0.02
        q, s = quantize_weight_blockwise(w)
        b_kn, s_kn = q.t().contiguous(), s.t().contiguous()
        packed, scales = quantize_mxfp4(w)
        for m in GEMM_BUCKETS:
            if sweep.over():
                return
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q_x, s_x = quantize_activation(x, 128)
            s_x = s_x.contiguous()

            def fp8(cfg: dict[str, Any], q_x=q_x, s_x=s_x, b_kn=b_kn, s_kn=s_kn
                    ) -> torch.Tensor:
                return fp8_block_gemm(q_x, s_x, b_kn, s_kn, 128, 128, torch.bfloat16,
                                      config=cfg)

            def fp4(cfg: dict[str, Any], x=x, packed=packed, scales=scales, k=k
                    ) -> torch.Tensor:
                return fp4_linear_triton(x, packed, scales, "e8m0", k, config=cfg)

            for op, run, default, fp8_kind in (("fp8_block_gemm", fp8, FP8_DEFAULT, True),
                                               ("fp4_gemm", fp4, FP4_DEFAULT, False)):
                found = sweep.best(run, gemm_candidates(m, fp8_kind), dict(default))
                if found:
                    tables.setdefault(op, []).append(
                        {"shape": {"N": n, "K": k, "M": m}, **found})
                    print(op, n, k, m, found, flush=True)


def tune_moe(sweep: Sweep, tables: dict[str, list[dict[str, Any]]]) -> None:
    from inference_engine.layers.moe.dispatch import align_block_size
    from inference_engine_quant.fp8_math import quantize_weight_per_channel
    from inference_engine_quant.kernels.quant_moe_gemm import quant_grouped_gemm
    from inference_engine_quant.mx_block import quantize_mxfp4
    from inference_engine_quant.quant_moe import _default_config

    dev = "cuda"
    e, topk, hidden, inter = MOE["E"], MOE["topk"], MOE["hidden"], MOE["inter"]
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        w = torch.randn(e, n, k, device=dev) * 0.02
        q, s = quantize_weight_per_channel(w.reshape(-1, k))
        fp8_w, fp8_s = q.view(e, n, k), s.view(e, n, 1)
        packed, scales = quantize_mxfp4(w)
        for t in MOE_BUCKETS:
            if sweep.over():
                return
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(e, device=dev)[:topk] for _ in range(t)])
            shape = {"M": t, "N": n, "K": k, "E": e, "topk": topk}
            for op, wt, sc, fmt, group in (("fused_moe_fp8", fp8_w, fp8_s, "fp8", (1, 1 << 30)),
                                           ("fused_moe_mxfp4", packed, scales, "mxfp4", (1, 32))):
                def run(cfg: dict[str, Any], wt=wt, sc=sc, fmt=fmt, group=group, ids=ids, t=t,
                        n=n, k=k, x=x) -> torch.Tensor:
                    sorted_ids, block_expert, num_padded = align_block_size(
                        ids, e, cfg["BLOCK_SIZE_M"])
                    c = torch.empty(t * topk, n, device=dev, dtype=torch.bfloat16)
                    quant_grouped_gemm(x, wt, sc, fmt, group, n, k, c, None, None, sorted_ids,
                                       block_expert, num_padded, topk, cfg)
                    return c

                found = sweep.best(run, moe_candidates(t), _default_config(shape))
                if found:
                    tables.setdefault(op, []).append({"shape": shape, **found})
                    print(op, shape, found, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True, help="writes <arch>/<op>.json under it")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--ops", default="gemm,moe", help="comma list of gemm, moe")
    args = parser.parse_args()
    import triton
    from inference_engine.platforms.selection import current_platform

    platform = current_platform()
    arch = platform.arch_name()
    sweep = Sweep(args.budget_s)
    tables: dict[str, list[dict[str, Any]]] = {}
    torch.manual_seed(0)
    for part in args.ops.split(","):
        try:
            {"gemm": tune_gemms, "moe": tune_moe}[part](sweep, tables)
        except Exception as exc:  # noqa: BLE001 - keep what was measured
            print(f"{part}: {type(exc).__name__}: {exc}", flush=True)
    out = Path(args.out_dir) / arch
    out.mkdir(parents=True, exist_ok=True)
    provenance = (f"bench/tune_gpu_kernels.py on {torch.cuda.get_device_name()}, triton "
                  f"{triton.__version__}, torch {torch.__version__}, "
                  f"{datetime.date.today().isoformat()}")
    for op, entries in tables.items():
        keys = ["N", "K", "E", "topk"] if op.startswith("fused_moe") else ["N", "K"]
        table = {"op": op, "arch": arch, "measured": True, "complete": sweep.complete,
                 "provenance": provenance, "match_keys": keys, "entries": entries}
        (out / f"{op}.json").write_text(json.dumps(table, indent=1))
        print(f"wrote {out / (op + '.json')}: {len(entries)} entries", flush=True)
    print(json.dumps({"arch": arch, "complete": sweep.complete,
                      "ops": {op: len(v) for op, v in tables.items()}}))


if __name__ == "__main__":
    main()
