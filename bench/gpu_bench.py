"""GPU engine benchmark: this engine vs transformers' generate on the same GPU, one run.

Bench model (the GPU-engine issue): a random Qwen3 with hidden 2048, 24 layers,
16 heads / 8 KV heads, head_dim 128, intermediate 6144, vocab 8192, bfloat16
(1.24 B parameters). Measures, for ours: batch-1 decode tok/s (decode only:
the time of 1 + N tokens minus that of 1), time to first token of a lone
512-token prompt, and offline throughput of 64 and 256 requests (prompts
16-512 tokens, 128 output tokens each); for transformers: batch-1 decode and a
static batch of 64 over the 64 requests. Also checks that a mixed prefill +
decode step runs without a host synchronisation. Prints one JSON object.

Run (on the GPU machine; see bench/gpu_check.sh):
    python bench/gpu_bench.py --out /tmp/gpu_bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from typing import Any

import torch
import transformers
from inference_engine import LLM, SamplingParams
from inference_engine.testing import word_level_tokenizer

HBM_BYTES_PER_S = 4.8e12  # H200


def build_model(path: str, device: str, layers: int) -> int:
    """Save the random bench model under ``path``; returns its parameter bytes."""
    config = transformers.Qwen3Config(
        vocab_size=8192, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=8191,
        bos_token_id=None, pad_token_id=0, dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    word_level_tokenizer(8192).save_pretrained(path)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return size


def workload(num_requests: int, seed: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(16, 512, num_requests).round().long()
    lengths = lengths[torch.randperm(num_requests, generator=rng)]
    return [torch.randint(0, 8191, (int(n),), generator=rng).tolist() for n in lengths]


def timed(fn: Any, sync: Any) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def ours(path: str, args: argparse.Namespace, sync: Any) -> dict[str, Any]:
    start = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", show_progress=False, max_model_len=1024,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization)
    engine = llm.engine
    result: dict[str, Any] = {
        "start_up_s": round(time.perf_counter() - start, 1),
        "capacity": engine.capacity_message,
        "graphs": engine.graphs_message,
        "attention_backends": sorted({type(layer.backend).__name__
                                      for layer in engine.runner.layers}),
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
    }

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    prompts = workload(256, 0)
    generate(prompts[:8], 8)  # warm-up: Triton kernels compiled for prefill shapes
    generate(prompts[:64], 4)
    # Batch-1 decode: time(1 + N tokens) - time(1 token), medians.
    decode_prompt = prompts[1][:32]
    n = args.new_tokens
    one = statistics.median(timed(lambda: generate([decode_prompt], 1), sync) for _ in range(3))
    full = statistics.median(timed(lambda: generate([decode_prompt], n + 1), sync)
                             for _ in range(3))
    result["batch1_decode_tok_s"] = round(n / (full - one), 1)
    result["batch1_end_to_end_tok_s"] = round((n + 1) / full, 1)
    # Time to first token of a lone 512-token prompt (fresh prompts: no prefix hits).
    rng = torch.Generator().manual_seed(1)
    lone = [torch.randint(0, 8191, (512,), generator=rng).tolist() for _ in range(5)]
    ttft = [timed(lambda p=p: generate([p], 1), sync) for p in lone]
    result["ttft_512_ms"] = round(1000 * statistics.median(ttft), 2)
    for count in (64, 256):
        batch = prompts[:count]
        seconds = timed(lambda b=batch: generate(b, n), sync)
        result[f"requests_{count}_tok_s"] = round(count * n / seconds, 1)
    result["sync_check"] = sync_check(llm)
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def sync_check(llm: LLM) -> str:
    """One mixed step (decodes + a prefill chunk after cached context) under the platform's
    host-sync check: "ok" or the error."""
    from inference_engine.engine.model_runner import StepBatch

    engine = llm.engine
    runner = engine.runner
    bs = runner.block_size
    lens = [(40, 1), (70, 1), (0, 48), (32, 64)]  # (cached, new) per sequence
    block_lists, next_block = [], 1
    for cached, new in lens:
        count = -(-(cached + new) // bs)
        block_lists.append(list(range(next_block, next_block + count)))
        next_block += count
    batch = StepBatch(
        token_ids=[[7] * (c + q) for c, q in lens], num_computed=[c for c, _ in lens],
        query_lens=[q for _, q in lens], block_lists=block_lists,
        sample_rows=[0, 1, 2, 3], prompt_rows=[],
    )
    try:
        with engine.platform.forbid_host_sync():
            logits = runner.execute_batch(batch)
            tokens = engine.sampler(logits.sample_logits, _random_sampling_batch(logits.sample_logits))
        tokens.sampled_token_ids.tolist()  # the one read per step, after the check
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"{type(exc).__name__}: {exc}"


def _random_sampling_batch(logits: torch.Tensor) -> Any:
    from inference_engine.sampling.batch import SamplingBatch

    rows = logits.shape[0]
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=None)] * rows
    return SamplingBatch.from_rows(params, [[]] * rows, logits.shape[1], device=logits.device)


def transformers_rates(path: str, args: argparse.Namespace, sync: Any) -> dict[str, Any]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16).to(args.device).eval()
    prompts = workload(256, 0)
    n = args.hf_new_tokens
    ids = torch.tensor([prompts[1][:32]], device=args.device)

    def gen(tokens: int) -> None:
        with torch.no_grad():
            model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                           pad_token_id=0)

    gen(2)
    one = timed(lambda: gen(1), sync)
    full = timed(lambda: gen(n + 1), sync)
    result = {"batch1_decode_tok_s": round(n / (full - one), 1)}
    batch = prompts[:64]
    width = max(len(p) for p in batch)
    x = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(x)
    for j, p in enumerate(batch):
        x[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    x, mask = x.to(args.device), mask.to(args.device)

    def static(tokens: int) -> None:
        with torch.no_grad():
            model.generate(x, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
                           min_new_tokens=tokens, pad_token_id=0)

    seconds = timed(lambda: static(args.new_tokens), sync)
    result["static_batch_64_tok_s"] = round(64 * args.new_tokens / seconds, 1)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-new-tokens", type=int, default=32,
                        help="batch-1 decode tokens for transformers (it is slow)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with tempfile.TemporaryDirectory() as path:
        size = build_model(path, args.device, args.layers)
        report: dict[str, Any] = {
            "model_bytes": size,
            "hbm_limit_batch1_tok_s": round(HBM_BYTES_PER_S / size, 1),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
        }
        report["ours"] = ours(path, args, sync)
        print(json.dumps(report), flush=True)
        if not args.skip_hf:
            report["transformers"] = transformers_rates(path, args, sync)
            o, t = report["ours"], report["transformers"]
            report["ratios"] = {
                "batch1_decode": round(o["batch1_decode_tok_s"] / t["batch1_decode_tok_s"], 2),
                "requests_64_vs_static_64": round(o["requests_64_tok_s"]
                                                  / t["static_batch_64_tok_s"], 2),
                "requests_256_vs_static_64": round(o["requests_256_tok_s"]
                                                   / t["static_batch_64_tok_s"], 2),
            }
        report["ours"]["batch1_fraction_of_hbm_limit"] = round(
            report["ours"]["batch1_decode_tok_s"] / report["hbm_limit_batch1_tok_s"], 3)
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
