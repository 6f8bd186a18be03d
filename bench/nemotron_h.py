"""Nemotron-H decode: this engine vs transformers on a bench-sized random hybrid, CPU, float32.

Model (issue 25): Nemotron-H pattern ``M E M E * E M -`` (Mamba-2, MoE, attention, MLP),
hidden 512; Mamba-2 16 heads x 64 channels (intermediate 1024), state 64, 4 groups,
conv kernel 4, SSD chunks of 64; MoE 16 relu² experts of 256, top-2 sigmoid routing, a
shared expert of 512; attention 8 heads / 2 KV heads of 64, no RoPE; MLP 1536; vocab 8192.
Random float32 weights (``randomize``, std 0.05).

Workload: ``batch`` prompts of ``prompt_len`` random token ids; each side generates
``1`` and ``1 + new_tokens`` tokens greedily; decode tokens/s = batch * new_tokens /
(time(1 + new_tokens) - time(1)), so the prefill is taken out. transformers runs
``generate`` on the unpadded ``[batch, prompt_len]`` ids (no padding: equal lengths),
with its pure-torch Mamba-2 path (no mamba-ssm / causal-conv1d kernels on CPU). The two
systems alternate; the median of ``--repeats`` runs is reported.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/nemotron_h.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_engine import SamplingParams  # noqa: E402
from inference_engine.testing import cpu_llm, word_level_tokenizer  # noqa: E402
from inference_engine.testing_parity import randomize  # noqa: E402

VOCAB = 8192


def bench_config() -> transformers.NemotronHConfig:
    return transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=512,
        layers_block_type=["linear_attention", "moe", "linear_attention", "moe",
                           "full_attention", "moe", "linear_attention", "mlp"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1536,
        mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64, n_groups=4, conv_kernel=4,
        chunk_size=64, n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=None, pad_token_id=0)


def build(path: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = randomize(transformers.AutoModelForCausalLM.from_config(bench_config()), std=0.05)
    model.save_pretrained(path)
    word_level_tokenizer(VOCAB).save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model


def ours_seconds(llm, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return elapsed


def hf_seconds(model, prompts: list[list[int]], tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                             attention_mask=torch.ones_like(ids))
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory() as path:
        hf = build(path)
        llm = cpu_llm(path, dtype="float32", enable_prefix_caching=False)
        print(llm.engine.capacity_message)
        gen = torch.Generator().manual_seed(1)
        for batch in args.batch:
            prompts = torch.randint(1, VOCAB - 1, (batch, args.prompt_len), generator=gen).tolist()
            ours_seconds(llm, prompts, 2)  # warm-up (oneDNN primitives per shape)
            if not args.skip_hf:
                hf_seconds(hf, prompts, 2)
            rates: dict[str, list[float]] = {"ours": [], "transformers": []}
            for _ in range(args.repeats):
                full = ours_seconds(llm, prompts, 1 + args.new_tokens)
                rates["ours"].append(batch * args.new_tokens
                                     / (full - ours_seconds(llm, prompts, 1)))
                if not args.skip_hf:
                    full = hf_seconds(hf, prompts, 1 + args.new_tokens)
                    rates["transformers"].append(batch * args.new_tokens
                                                 / (full - hf_seconds(hf, prompts, 1)))
            line = f"batch {batch}: ours {statistics.median(rates['ours']):.1f} decode tok/s"
            if rates["transformers"]:
                hf_rate = statistics.median(rates["transformers"])
                line += (f", transformers {hf_rate:.1f} tok/s "
                         f"({statistics.median(rates['ours']) / hf_rate:.2f}x)")
            print(line, {k: [round(v, 1) for v in vs] for k, vs in rates.items()}, flush=True)


if __name__ == "__main__":
    main()
