"""Tensor / expert parallelism: tokens/s and per-step collective time, 1 rank vs N ranks.

The same random model and workload run through ``LLM(tensor_parallel_size=tp)`` for
each ``--tp`` (the mp executor: rank 0 in this process, the others spawned), then through
``LLM(data_parallel_size=dp)`` for each ``--dp`` (the data-parallel front end: DP rank 0
here, the others spawned engines; requests balanced by queue length, MoE experts over the
DP ranks with ``--moe``). Rank 0's
collectives are timed (each waits for completion, so the time includes waiting for the
slowest rank); per step = their total / engine steps. On the CPU the ranks use gloo and
share the host's cores (``threads / tp`` each); on a multi-GPU machine the same command
uses NCCL, one GPU per rank (``--device-ids`` picks them).

Model: Qwen3, hidden 1024, 8 layers, 16 heads / 8 KV heads of 64, MLP 3072, vocab
8192, bfloat16 random weights (``--moe``: Qwen3-MoE, 16 experts of 512, top-2, with
``--enable-expert-parallel`` for EP over the same ranks).

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/distributed.py --tp 1,2 [--dp 2] [--moe] \
          [--platform cpu] [--requests 8 --prompt-tokens 128 --output-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_engine import LLM, SamplingParams  # noqa: E402
from inference_engine.distributed.parallel_state import parallel_state  # noqa: E402
from inference_engine.testing import word_level_tokenizer  # noqa: E402

VOCAB = 8192


def build_model(path: str, moe: bool, layers: int) -> None:
    common = dict(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  eos_token_id=VOCAB - 1, bos_token_id=None, pad_token_id=0)
    if moe:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=3072, moe_intermediate_size=512, num_experts=16,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            intermediate_size=3072, **common))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    word_level_tokenizer(VOCAB).save_pretrained(path)


def measure(path: str, tp: int, args: argparse.Namespace, dp: int = 1) -> dict[str, float]:
    llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, platform=args.platform,
              dtype="bfloat16", enable_expert_parallel=args.moe and tp * dp > 1,
              all2all_backend=args.all2all,
              enable_prefix_caching=False, show_progress=False,
              max_num_batched_tokens=args.requests * args.prompt_tokens)
    engine = llm.engine
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB - 1, (args.prompt_tokens,), generator=rng).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        state = parallel_state()
        # With DP, rank 0's lockstep announcements (dp group) count as collectives too.
        groups = {id(g): g for g in (state.tp, state.ep, state.dp)}.values()
        for group in groups:
            group.timer.reset()
            group.timer.enabled = True
        for prompt in prompts:
            engine.add_request(prompt, params)
        steps, generated = 0, 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    generated += len(output.outputs[0].token_ids)
            steps += 1
        elapsed = time.perf_counter() - start
        collective = sum(g.timer.seconds for g in groups)
        calls = sum(g.timer.calls for g in groups)
        by_op: dict[str, float] = {}
        for group in groups:
            for op, seconds in group.timer.by_op.items():
                by_op[op] = by_op.get(op, 0.0) + seconds
            group.timer.enabled = False
    finally:
        engine.shutdown()
    routed = getattr(engine, "requests_routed", None)
    return {"routed": routed, "tok_s": generated / elapsed, "steps": steps,
            "step_ms": 1e3 * elapsed / steps,
            "collective_ms_per_step": 1e3 * collective / steps,
            "collectives_per_step": calls / steps,
            **{f"{op}_ms_per_step": 1e3 * s / steps for op, s in by_op.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2", help="comma-separated rank counts to compare")
    parser.add_argument("--dp", default="", help="comma-separated DP sizes to run (tp=1 each)")
    parser.add_argument("--moe", action="store_true", help="Qwen3-MoE with expert parallelism")
    parser.add_argument("--all2all", default="allgather_reducescatter",
                        choices=["allgather_reducescatter", "alltoall"])
    parser.add_argument("--platform", default=None, help="force a platform (default: auto)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory() as path:
        build_model(path, args.moe, args.layers)
        print(f"{'MoE' if args.moe else 'dense'} model, {args.requests} requests x "
              f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens")
        runs = [(int(t), 1) for t in args.tp.split(",") if t]
        runs += [(1, int(d)) for d in args.dp.split(",") if d]
        for tp, dp in runs:
            r = measure(path, tp, args, dp)
            ops = ", ".join(f"{k.removesuffix('_ms_per_step')} {v:.2f}" for k, v in r.items()
                            if k.endswith("_ms_per_step") and not k.startswith("collective"))
            label = f"tp={tp}" if dp == 1 else f"dp={dp} (requests per rank {r['routed']})"
            print(f"{label}: {r['tok_s']:8.1f} tok/s, {r['steps']} steps of "
                  f"{r['step_ms']:.1f} ms, collectives {r['collective_ms_per_step']:.2f} ms/step "
                  f"({r['collectives_per_step']:.0f} calls/step{': ' + ops if ops else ''})",
                  flush=True)


if __name__ == "__main__":
    main()
