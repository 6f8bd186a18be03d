"""One workload through an autoregressive model and a block-diffusion model of similar size.

Prints, per model and diffusion setting: generated tokens per second, tokens per forward
(generated tokens / the model passes that produced them: 1 for AR decoding; committed
tokens / decoder passes for diffusion, transformers' ``tokens_per_forward``), steps per
block (decoder passes per committed block) and engine steps.

Both models are random (tiny tokenizer, float32 on the CPU platform): the speed figures
are the engine's cost, not a trained model's quality or its adaptive-stop behaviour (a
random model is never confident, so with the checkpoint defaults every block takes all
``max_denoising_steps``; the deterministic recipe is confident at once and stops as soon
as the argmax is stable).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/ar_vs_diffusion.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from inference_engine import SamplingParams
from inference_engine.testing import cpu_llm, make_tiny_model, train_tiny_tokenizer
from inference_engine.testing_diffusion import DETERMINISTIC_RECIPE, make_tiny_diffusion_gemma


def num_params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape())
                   for k in f.keys() if "vision" not in k and ".encoder." not in k)


def _prod(shape: list[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def run(llm, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    engine = llm.engine
    stepper = engine.diffusion
    passes0 = stepper.num_passes if stepper else 0
    blocks0 = stepper.num_blocks if stepper else 0
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, params.clone(),
                           request_id=f"b{i}-{time.time()}")
    steps, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        steps += 1
    elapsed = time.perf_counter() - start
    if stepper is None:
        forwards, blocks = tokens, 0  # one decode pass per generated token (per request)
    else:
        forwards, blocks = stepper.num_passes - passes0, stepper.num_blocks - blocks0
    return {"tok_s": tokens / elapsed, "tokens_per_forward": tokens / max(forwards, 1),
            "steps_per_block": forwards / blocks if blocks else float("nan"),
            "engine_steps": steps, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--canvas", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = train_tiny_tokenizer()
    root = Path(tempfile.mkdtemp(prefix="ar_vs_diffusion_"))
    ar_path = make_tiny_model(root / "ar", "qwen3", tokenizer=tokenizer, hidden_size=256,
                              intermediate_size=1024, num_hidden_layers=4, head_dim=64)
    dg_path = make_tiny_diffusion_gemma(root / "dg", canvas_length=args.canvas,
                                        tokenizer=tokenizer, hidden_size=256, num_layers=4,
                                        intermediate_size=512, moe_intermediate_size=256,
                                        head_dim=64, global_head_dim=64)
    print(f"AR (qwen3) {num_params(ar_path) / 1e6:.2f} M parameters; DiffusionGemma (text, "
          f"shared encoder/decoder) {num_params(dg_path) / 1e6:.2f} M; {args.requests} requests, "
          f"{args.prompt_len}-token prompts, {args.max_tokens} new tokens, canvas {args.canvas}")
    prompts = [[(7 * i + j) % 300 + 3 for j in range(args.prompt_len)]
               for i in range(args.requests)]
    ar = cpu_llm(ar_path, max_model_len=512)
    dg = cpu_llm(dg_path, max_model_len=512)
    cases = [
        ("AR qwen3, greedy", ar, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                ignore_eos=True)),
        ("diffusion, checkpoint defaults (48 steps, t 0.4..0.8)", dg,
         SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0)),
        ("diffusion, 8 steps max", dg,
         SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0,
                        extra_args={"max_denoising_steps": 8})),
        ("diffusion, one step per block (stability 0, confidence 1e9)", dg,
         SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0,
                        extra_args={"stability_threshold": 0, "confidence_threshold": 1e9})),
        ("diffusion, deterministic recipe", dg,
         SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                        extra_args=dict(DETERMINISTIC_RECIPE))),
    ]
    for _name, llm, params in cases:  # warm-up (oneDNN primitives, first-call costs)
        run(llm, prompts[:2], params)
    print(f"{'case':60s} {'tok/s':>8s} {'tok/fwd':>8s} {'steps/blk':>9s} {'eng steps':>9s}")
    for name, llm, params in cases:
        results = [run(llm, prompts, params) for _ in range(args.runs)]
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(f"{name:60s} {med['tok_s']:8.1f} {med['tokens_per_forward']:8.2f} "
              f"{med['steps_per_block']:9.2f} {med['engine_steps']:9.0f}")


if __name__ == "__main__":
    main()
