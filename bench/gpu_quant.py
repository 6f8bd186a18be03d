"""Quantized kernels on the GPU against torch's bf16 matmul on the same shapes, and end-to-end
decode of the bench model and a small MoE in bf16, FP8 (128x128 block), PTPC and MXFP4.

Kernels (``triton.testing.do_bench``, median ms; GB/s on the weight bytes read,
TFLOP/s at 2*M*N*K), N = K = 4096, M in 1, 16, 64, 512, 4096, each through the
layer path the engine runs (activation quantization included):

* ``bf16``: ``x @ w`` (torch);
* ``fp8_block``: 128x128 block FP8 (Triton block GEMM, split-K at small M);
* ``fp8_tensor`` / ``ptpc``: per-tensor / per-channel weight with per-token
  activations (``torch._scaled_mm`` where the platform lists it);
* ``mxfp4`` / ``nvfp4``: FP4 weight-only dequant-GEMM (Triton, split-K at small M).

Fused MoE, 64 experts, top-8, hidden 2048, intermediate 768, T in 1, 64, 256:
bf16 (core Triton grouped GEMM), FP8 (per-row scales) and MXFP4 experts (the
quantized grouped GEMM); GB/s on the bytes of the experts the routing touched.

End to end (``--e2e``): batch-1 decode tok/s (time of 1+N tokens minus 1) and
weight bytes of the bench model (hidden 2048, ``--layers`` layers) and of a
small random Qwen3-MoE, each in bf16, fp8 block (``inference-engine quantize
--method fp8-block``), ptpc_fp8 and mxfp4 (online). Prints one JSON object.

Run on the GPU (a step of bench/gpu_check.sh):
    python bench/gpu_quant.py --out $OUT/gpu_quant.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HBM_BYTES_PER_S = 4.8e12  # H200 (the H100's is 3.35e12: say which card ran)


def bench_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50))


def _rates(ms: float, weight_bytes: int, m: int, n: int, k: int) -> dict[str, Any]:
    return {"ms": round(ms, 4), "weight_GB_s": round(weight_bytes / ms / 1e6, 1),
            "hbm_fraction": round(weight_bytes / (ms / 1e3) / HBM_BYTES_PER_S, 3),
            "TFLOP_s": round(2 * m * n * k / ms / 1e9, 1)}


def gemm_section(platform: Any, ms_list: list[int], n: int, k: int) -> dict[str, Any]:
    from inference_engine_quant.fp8_linear import apply_fp8_linear, finalize_fp8_layer
    from inference_engine_quant.fp8_math import (
        quantize_weight_blockwise,
        quantize_weight_per_channel,
        quantize_weight_per_tensor,
    )
    from inference_engine_quant.kernels.fp4_gemm import fp4_linear_triton
    from inference_engine_quant.mx_block import quantize_mxfp4
    from inference_engine_quant.nvfp4_codec import quantize_nvfp4

    dev = platform.device()
    w = torch.randn(n, k, device=dev) * 0.02
    w_kn = w.t().contiguous().to(torch.bfloat16)
    layers: dict[str, Any] = {}
    for name, (q, s, _block) in {
        "fp8_block": (*quantize_weight_blockwise(w), (128, 128)),
        "fp8_tensor": (*quantize_weight_per_tensor(w), None),
        "ptpc": (*quantize_weight_per_channel(w), None),
    }.items():
        layer = torch.nn.Module()
        if name == "fp8_block":
            scale_kn, block_kn = s.t(), (128, 128)
        elif name == "fp8_tensor":
            scale_kn, block_kn = s.reshape(1, 1).expand(1, n), (k, 1)
        else:
            scale_kn, block_kn = s.reshape(1, n), (k, 1)
        finalize_fp8_layer(layer, q.t(), scale_kn.contiguous(), block_kn, None, True, platform,
                           torch.bfloat16)
        layers[name] = layer
    mx_packed, mx_scales = quantize_mxfp4(w)
    nv_packed, nv_scales, nv_g = quantize_nvfp4(w)
    nv_rows = torch.full((n,), float(nv_g), device=dev)
    bytes_ = {"bf16": n * k * 2, "fp8_block": n * k + 4 * (n // 128) * (k // 128),
              "fp8_tensor": n * k, "ptpc": n * k + 4 * n,
              "mxfp4": n * k // 2 + n * k // 32, "nvfp4": n * k // 2 + n * k // 16}
    result: dict[str, Any] = {"N": n, "K": k,
                              "kernels": {name: layers[name].fp8_kernel for name in layers}}
    for m in ms_list:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        runs = {
            "bf16": lambda x=x: x @ w_kn,
            **{name: (lambda x=x, lay=lay: apply_fp8_linear(lay, x))
               for name, lay in layers.items()},
            "mxfp4": lambda x=x: fp4_linear_triton(x, mx_packed, mx_scales, "e8m0", k),
            "nvfp4": lambda x=x: fp4_linear_triton(x, nv_packed, nv_scales, "e4m3", k,
                                                   global_scale=nv_rows),
        }
        row: dict[str, Any] = {}
        ref = runs["bf16"]().float()
        for name, fn in runs.items():
            try:
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                row[name] = {**_rates(bench_ms(fn), bytes_[name], m, n, k),
                             "rel_err_vs_bf16": round(err, 4)}
            except Exception as exc:  # noqa: BLE001 - report and go on
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        base = row["bf16"].get("ms")
        for name in row:
            if base and "ms" in row[name]:
                row[name]["speed_vs_bf16"] = round(base / row[name]["ms"], 2)
        result[f"M={m}"] = row
        print(json.dumps({f"gemm M={m}": row}), flush=True)
    return result


def moe_section(platform: Any, tokens: list[int]) -> dict[str, Any]:
    from inference_engine.layers.moe.triton_moe import fused_moe_triton
    from inference_engine_quant.fp8_math import quantize_weight_per_channel
    from inference_engine_quant.mx_block import quantize_mxfp4
    from inference_engine_quant.quant_moe import QuantExperts, fused_moe_quant_triton

    dev = platform.device()
    e, topk, hidden, inter = 64, 8, 2048, 768
    gate_up = torch.randn(e, 2 * inter, hidden, device=dev) * 0.02
    down = torch.randn(e, hidden, inter, device=dev) * 0.02
    fp8 = []
    for w in (gate_up, down):
        q, s = quantize_weight_per_channel(w.reshape(-1, w.shape[-1]))
        fp8 += [q.view(w.shape), s.view(*w.shape[:2], 1)]
    mx = []
    for w in (gate_up, down):
        mx += list(quantize_mxfp4(w))
    experts = {
        "fp8": QuantExperts("fp8", fp8[0], fp8[1], fp8[2], fp8[3], hidden, inter, (1, 1 << 30)),
        "mxfp4": QuantExperts("mxfp4", mx[0], mx[1], mx[2], mx[3], hidden, inter, (1, 32)),
    }
    per_expert = {"bf16": 3 * inter * hidden * 2, "fp8": 3 * inter * hidden + 4 * 3 * inter,
                  "mxfp4": 3 * inter * hidden // 2 + 3 * inter * hidden // 32}
    gu16, dn16 = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    result: dict[str, Any] = {"E": e, "topk": topk, "hidden": hidden, "inter": inter}
    for t in tokens:
        x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device=dev)[:topk] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, topk, device=dev), -1)
        touched = int(torch.unique(ids).numel())
        runs = {"bf16": lambda x=x, ids=ids, wt=weights: fused_moe_triton(x, gu16, dn16, wt, ids),
                **{name: (lambda x=x, ids=ids, wt=weights, ex=ex:
                          fused_moe_quant_triton(x, ex, wt, ids))
                   for name, ex in experts.items()}}
        row: dict[str, Any] = {"experts_touched": touched}
        ref = runs["bf16"]().float()
        for name, fn in runs.items():
            try:
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                ms = bench_ms(fn)
                weight_bytes = touched * per_expert[name]
                row[name] = {"ms": round(ms, 4),
                             "weight_GB_s": round(weight_bytes / ms / 1e6, 1),
                             "hbm_fraction": round(weight_bytes / (ms / 1e3) / HBM_BYTES_PER_S,
                                                   3),
                             "rel_err_vs_bf16": round(err, 4)}
            except Exception as exc:  # noqa: BLE001
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        result[f"T={t}"] = row
        print(json.dumps({f"moe T={t}": row}), flush=True)
    return result


def _decode_rate(path: str, quantization: str | None, new_tokens: int) -> dict[str, Any]:
    from inference_engine import LLM, SamplingParams
    from inference_engine_quant.mx_linear import quantized_weight_bytes

    llm = LLM(path, dtype="bfloat16", quantization=quantization, show_progress=False,
              max_model_len=512, enable_prefix_caching=False, gpu_memory_utilization=0.5)
    params1 = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens + 1)
    prompt = [{"prompt_token_ids": list(range(5, 37))}]

    def timed(p: Any, engine: Any = llm) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompt, p, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(params)  # warm-up (compiles)
    one = statistics.median(timed(params1) for _ in range(3))
    full = statistics.median(timed(params) for _ in range(3))
    row: dict[str, Any] = {"batch1_decode_tok_s": round(new_tokens / (full - one), 1)}
    try:
        model = llm.engine.runner.model
        row["weight_bytes"] = quantized_weight_bytes(model)
    except Exception as exc:  # noqa: BLE001 - the engine's internals may differ
        row["weight_bytes"] = f"unavailable: {type(exc).__name__}"
    llm = None
    gc.collect()
    torch.cuda.empty_cache()
    return row


def e2e_section(args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    from inference_engine.testing import word_level_tokenizer
    from inference_engine_quant.quantize_cli import quantize_checkpoint

    result: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp())
    configs = {
        "bench_model": transformers.Qwen3Config(
            vocab_size=8192, hidden_size=2048, intermediate_size=6144,
            num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=1024, tie_word_embeddings=False,
            eos_token_id=8191, bos_token_id=None, pad_token_id=0),
        "moe_model": transformers.Qwen3MoeConfig(
            vocab_size=8192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_experts=64, num_experts_per_tok=8, num_hidden_layers=max(2, args.layers // 3),
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=8191,
            bos_token_id=None, pad_token_id=0),
    }
    for name, config in configs.items():
        path = root / name
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(path)
        word_level_tokenizer(8192).save_pretrained(path)
        del model
        torch.cuda.empty_cache()
        rows: dict[str, Any] = {}
        for variant in ("bf16", "fp8_block", "ptpc_fp8", "mxfp4"):
            try:
                if variant == "fp8_block":
                    qpath = root / f"{name}_fp8_block"
                    quantize_checkpoint(path, qpath, "fp8-block", layout="NK",
                                        show_progress=False)
                    rows[variant] = _decode_rate(str(qpath), None, args.new_tokens)
                else:
                    method = None if variant == "bf16" else variant
                    rows[variant] = _decode_rate(str(path), method, args.new_tokens)
            except Exception as exc:  # noqa: BLE001
                rows[variant] = {"error": f"{type(exc).__name__}: {exc}"[:300],
                                 "trace": traceback.format_exc()[-600:]}
            print(json.dumps({f"e2e {name} {variant}": rows[variant]}), flush=True)
        result[name] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--m", default="1,16,64,512,4096")
    parser.add_argument("--moe-tokens", default="1,64,256")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    from inference_engine.platforms.selection import current_platform

    platform = current_platform()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                              "hbm_limit_bytes_s": HBM_BYTES_PER_S}
    out = Path(args.out)
    sections = [("gemm", lambda: gemm_section(platform, [int(v) for v in args.m.split(",")],
                                              4096, 4096)),
                ("moe", lambda: moe_section(platform,
                                            [int(v) for v in args.moe_tokens.split(",")]))]
    if not args.no_e2e:
        sections.append(("e2e", lambda: e2e_section(args)))
    for name, fn in sections:
        try:
            report[name] = fn()
        except Exception as exc:  # noqa: BLE001 - keep the other sections
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:300],
                            "trace": traceback.format_exc()[-800:]}
        out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
