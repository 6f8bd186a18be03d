"""MXFP4 / NVFP4 / MXFP8 vs bf16 on the benchmark model: weight memory, agreement, KL, decode tok/s.

Model: the issue-3 benchmark model of bench/offline_throughput.py (random
Qwen3, hidden 512, 8 layers, 8/4 heads, intermediate 1536, vocab 8192,
bfloat16). Runs: bf16; ``mxfp4`` online with weights kept packed (tiled
dequantize per matmul); ``mxfp4 --dequantize-at-load``; ``mxfp4`` written by
``inference-engine quantize`` and loaded from disk; ``nvfp4`` online (W4A16)
packed and dequantized at load; ``mxfp8`` online; checkpoints written from the
same weights in AWQ (GEMM, group 128) and GPTQ (4-bit, group 128, sym) with the
formulas of their reference code, and in compressed-tensors W4A16, W8A8 (INT8)
and FP8_DYNAMIC by the compressed-tensors library. For each: bytes of the
decoder linear weights (packed values + scales) vs bf16 and of the whole
model, top-1 agreement and mean KL(bf16 || method) of next-token
distributions over 2,000 positions (16 random-token sequences of 125), and
generated tokens/s at batch 1 and batch 16 (64 new tokens each, 32-token prompts).

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/quant.py [--layers 8] [--runs awq,gptq]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers
from inference_engine import LLM, SamplingParams
from inference_engine.testing import word_level_tokenizer
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.quantize_cli import quantize_checkpoint
from inference_engine_quant.quantize_memory import weight_memory_report


def build_model(path: Path, layers: int) -> None:
    """The bench/offline_throughput.py model, saved in bfloat16."""
    config = transformers.Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=8191, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    word_level_tokenizer(8192).save_pretrained(path)


def write_int_checkpoints(base: Path, root: Path) -> dict[str, Path]:
    """AWQ, GPTQ and compressed-tensors copies of the bf16 model (quant-format test writers)."""
    from inference_engine_quant.ct_testing import write_ct_checkpoint
    from inference_engine_quant.int_testing import awq_tensors, gptq_tensors
    from inference_engine_quant.mx_testing import write_quantized_checkpoint

    paths = {}
    for name, quantize, config in [
        ("awq", lambda m, w: awq_tensors(w, 128),
         {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
          "version": "gemm"}),
        ("gptq", lambda m, w: gptq_tensors(w, 4, 128, True),
         {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}),
    ]:
        write_quantized_checkpoint(base, root / name, root / f"{name}-dq", quantize,
                                   quantization_config=config)
        paths[name] = root / name
    for preset in ("W4A16", "W8A8", "FP8_DYNAMIC"):
        write_ct_checkpoint(base, root / preset, root / f"{preset}-dq", preset)
        paths[preset] = root / preset
    return paths


def distribution_stats(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || got)) over all positions."""
    agree = total = 0
    kl = 0.0
    for r, g in zip(ref, got, strict=True):
        lr, lg = torch.log_softmax(r.float(), -1), torch.log_softmax(g.float(), -1)
        kl += (lr.exp() * (lr - lg)).sum().item()
        agree += (r.argmax(-1) == g.argmax(-1)).sum().item()
        total += r.shape[0]
    return agree / total, kl / total


def decode_rate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tokens/s for ``prompts`` run together (greedy, ignore_eos)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=16, help="125-token texts for KL/top-1")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--runs", default="", help="comma-separated substrings of run names "
                        "to keep (bf16 always runs); default all")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    rng = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, 8191, (125,), generator=rng).tolist() for _ in range(args.sequences)]
    prompts = [torch.randint(0, 8191, (32,), generator=rng).tolist() for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "bf16"
        print(f"building the model in {base} ...", flush=True)
        build_model(base, args.layers)
        exported = Path(tmp) / "mxfp4-ckpt"
        quantize_checkpoint(base, exported, "mxfp4", show_progress=False)
        runs = [
            ("bf16", base, None, False),
            ("mxfp4 online, packed", base, "mxfp4", False),
            ("mxfp4 online, dequantize-at-load", base, "mxfp4", True),
            ("mxfp4 checkpoint (quantize CLI), packed", exported, None, False),
            ("nvfp4 online W4A16, packed", base, "nvfp4", False),
            ("nvfp4 online W4A16, dequantize-at-load", base, "nvfp4", True),
            ("mxfp8 online, packed", base, "mxfp8", False),
        ]
        ints = write_int_checkpoints(base, Path(tmp))
        runs += [
            ("AWQ checkpoint (int4 g128, zero points)", ints["awq"], None, False),
            ("GPTQ checkpoint (int4 g128, sym)", ints["gptq"], None, False),
            ("GPTQ checkpoint, dequantize-at-load", ints["gptq"], None, True),
            ("compressed-tensors W4A16 (int4 g128)", ints["W4A16"], None, False),
            ("compressed-tensors W8A8 (INT8, per-token)", ints["W8A8"], None, False),
            ("compressed-tensors FP8_DYNAMIC", ints["FP8_DYNAMIC"], None, False),
        ]
        keep = [k for k in args.runs.split(",") if k]
        if keep:
            runs = [r for r in runs if r[0] == "bf16" or any(k in r[0] for k in keep)]
        ref_logits: list[torch.Tensor] = []
        rows = []
        for name, path, method, deq in runs:
            loaded = load_for_test(str(path), quantization=method, dtype="bfloat16",
                                   dequantize_at_load=deq)
            logits = [prefill_logits(loaded, t) for t in texts]
            if not ref_logits:
                ref_logits = logits
            agree, kl = distribution_stats(ref_logits, logits)
            report = weight_memory_report(loaded.model)
            del loaded
            llm = LLM(str(path), quantization=method, dtype="bfloat16", show_progress=False,
                      dequantize_at_load=deq, kv_cache_memory=256 << 20,
                      enable_prefix_caching=False)
            decode_rate(llm, prompts[:2], 4)  # warm-up
            single = decode_rate(llm, prompts[:1], args.new_tokens)
            batched = decode_rate(llm, prompts, args.new_tokens)
            method_cls = type(llm.engine.model.model.layers[0].mlp.down_proj.quant_method)
            kernel = ("dense matmul (weights dequantized at load)" if deq
                      else method_cls.kernel_for(llm.engine.platform))
            del llm
            rows.append((name, report, agree, kl, single, batched, kernel))
            print(f"{name}: {report.format()}, top-1 {agree:.4f}, KL {kl:.2e}, "
                  f"{single:.1f} tok/s (batch 1), {batched:.1f} tok/s (batch {args.batch})",
                  flush=True)
    positions = sum(len(t) for t in texts)
    print(f"\n{positions} positions; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print(f"| run | linear weights | vs bf16 | whole model | top-1 vs bf16 | KL vs bf16 | "
          f"tok/s batch 1 | tok/s batch {args.batch} | matmul path |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for name, report, agree, kl, single, batched, kernel in rows:
        print(f"| {name} | {report.linear_bytes / mib:.2f} MiB | "
              f"{report.linear_ratio_vs_bf16:.3f}x | {report.total_bytes / mib:.1f} MiB | "
              f"{agree:.4f} | {kl:.2e} | {single:.1f} | {batched:.1f} | {kernel} |")


if __name__ == "__main__":
    main()
