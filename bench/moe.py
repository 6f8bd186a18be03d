"""MoE offline throughput: this engine vs transformers on a random Qwen3-MoE, same work.

Model (issue 8): Qwen3-MoE, 8 layers, 16 experts, top-2, hidden 512, expert
intermediate 512, 8 heads / 4 KV heads of 64, vocab 8192, bfloat16 random
weights. Workload: the 64 requests of ``bench/offline_throughput.py`` (prompt
lengths spread over 16-512 tokens, 128 output tokens each, ignore_eos), built
by that script's own ``workload`` function; both engines are timed by its
``ours_throughput`` / ``hf_throughput`` helpers.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/moe.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_engine import LLM  # noqa: E402
from inference_engine.testing import word_level_tokenizer  # noqa: E402
from offline_throughput import (  # noqa: E402
    hf_throughput,
    median_runs,
    ours_throughput,
    workload,
)


def build_model(path: str, layers: int, experts: int, top_k: int) -> None:
    config = transformers.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=8191, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # a spread-out router so tokens really use many experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    word_level_tokenizer(8192).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement (median)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    rng = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        print(f"building the model in {path} ...", flush=True)
        build_model(path, args.layers, args.experts, args.top_k)
        prompts = workload(args.num_requests, rng)
        llm = LLM(path, dtype="bfloat16", show_progress=False, enable_prefix_caching=False)
        print(llm.engine.capacity_message)
        ours_throughput(llm, prompts[:4], 8)  # warm-up
        measure = {"ours": lambda: ours_throughput(llm, prompts, args.output_tokens)}
        if not args.skip_hf:
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            hf.eval()
            hf_throughput(hf, prompts[:4], 8, args.hf_batch)  # warm-up
            measure["transformers"] = lambda: hf_throughput(hf, prompts, args.output_tokens,
                                                            args.hf_batch)
        results = median_runs(measure, args.repeats)
        print(f"\nmedian of {args.repeats} run(s), {args.num_requests} requests x "
              f"{args.output_tokens} output tokens")
        for name, value in results.items():
            print(f"{name:14s} {value:9.1f} tok/s")
        if "transformers" in results:
            print(f"ratio ours/transformers: {results['ours'] / results['transformers']:.2f}x")


if __name__ == "__main__":
    main()
