"""FP8 methods vs bf16 on the benchmark model: weight bytes, agreement, KL, tokens/s on CPU.

Model: the issue-3 benchmark model (random Qwen3, hidden 512, 8 layers, 8/4
heads, intermediate 1536, vocab 8192, bfloat16). Methods: ``fp8`` online
(per tensor), ``fp8-block`` (written by ``inference-engine quantize``, loaded
from disk), ``ptpc_fp8`` online, and ``fp8-block`` with ``--dequantize-at-load``.
For each: bytes of the linear weights vs bf16, top-1 agreement and mean
KL(bf16 || method) of next-token distributions over 2,000 positions
(16 random-token sequences of 125), and generated tokens/s (16 requests x 64
tokens, and batch-1 decode).

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/quant_fp8.py [--layers 8]
      [--init-std 0.08 --skip-throughput]   (decisive predictions: agreement only)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from inference_engine import LLM
from inference_engine.testing import word_level_tokenizer
from inference_engine_quant.fp8_testing import load_for_test, prefill_logits
from inference_engine_quant.quantize_cli import quantize_checkpoint
from inference_engine_quant.quantize_memory import weight_memory_report

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant import decode_rate, distribution_stats  # noqa: E402


def build_model(path: Path, layers: int, init_std: float | None = None) -> None:
    config = transformers.Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=8191, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    if init_std is not None:
        # transformers' default init (std 0.02) gives nearly flat next-token distributions,
        # where top-1 agreement is mostly noise; a wider spread gives decisive predictions.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, init_std)
    model.to(torch.bfloat16).save_pretrained(path)
    word_level_tokenizer(8192).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--init-std", type=float, default=None,
                        help="re-initialise 2-D weights N(0, std) (default: transformers' init)")
    parser.add_argument("--skip-throughput", action="store_true",
                        help="only weight bytes, agreement and KL")
    args = parser.parse_args()
    rng = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, 8191, (125,), generator=rng).tolist() for _ in range(args.sequences)]
    prompts = [torch.randint(0, 8191, (64,), generator=rng).tolist() for _ in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "bf16"
        build_model(base, args.layers, args.init_std)
        block = Path(tmp) / "fp8-block"
        quantize_checkpoint(base, block, "fp8-block", show_progress=False)
        runs = [
            ("bf16", base, None, False),
            ("fp8 (online, per tensor)", base, "fp8", False),
            ("fp8-block (quantize CLI)", block, None, False),
            ("ptpc_fp8 (online)", base, "ptpc_fp8", False),
            ("fp8-block, dequantize-at-load", block, None, True),
        ]
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
            kernel = next((m.fp8_kernel for m in loaded.model.modules()
                           if hasattr(m, "fp8_kernel")), "dense")
            del loaded
            batched = single = float("nan")
            if not args.skip_throughput:
                llm = LLM(str(path), quantization=method, dtype="bfloat16", show_progress=False,
                          dequantize_at_load=deq, kv_cache_memory=256 << 20)
                decode_rate(llm, prompts[:2], 4)  # warm-up
                batched = decode_rate(llm, prompts, args.new_tokens)
                single = decode_rate(llm, prompts[:1], args.new_tokens)
                del llm
            rows.append((name, report.linear_bytes, report.linear_ratio_vs_bf16, agree, kl,
                         batched, single, kernel))
            print(f"{name}: linear {report.linear_bytes / 2**20:.1f} MiB "
                  f"({report.linear_ratio_vs_bf16:.3f}x), top-1 {agree:.4f}, KL {kl:.2e}, "
                  f"{batched:.1f} tok/s (16 req), {single:.1f} tok/s (batch 1), {kernel}",
                  flush=True)
    positions = sum(len(t) for t in texts)
    print(f"\n{positions} positions; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| method | linear weights | vs bf16 | top-1 vs bf16 | KL vs bf16 | tok/s, 16 req x "
          f"{args.new_tokens} | tok/s, batch 1 | kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for name, nbytes, ratio, agree, kl, batched, single, kernel in rows:
        print(f"| {name} | {nbytes / 2**20:.1f} MiB | {ratio:.3f}x | {agree:.4f} | {kl:.2e} | "
              f"{batched:.1f} | {single:.1f} | {kernel} |")


if __name__ == "__main__":
    main()
