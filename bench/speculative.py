"""Speculative decoding on CPU: acceptance length and speed-up against the same engine
without speculation, side by side in one process (issue 27).

Target: the committed demo model (models/demo-qwen3-tiny, trained Qwen3, 2M parameters,
float32), greedy, ``ignore_eos``. Cases, each timed against plain decoding alternately
(median of ``--reps`` runs, after one warm-up run each):

* ``ngram``: prompt lookup (k=4, n-grams of 2..4) on a repetitive workload (numbered lists,
  repeated code lines), at batch 1 and batch 4.
* ``draft_model``: a drafter made from the demo model itself by keeping its first layer
  (embedding, final norm and head unchanged): a smaller model of the same vocabulary,
  k=3. (Training a separate drafter for minutes on this 2-core machine was not done.)
* ``draft_model (self)``: the demo model drafting for itself, an upper bound on
  acceptance (every greedy draft is the target's own pick) that shows what the drafter's
  forwards cost.
* ``eagle3`` / ``dflash``: random drafters in the public checkpoint layouts (no trained one
  exists for the demo model): what drafting costs, acceptance near zero by construction.

Each row reports output tok/s with and without speculation, the speed-up, the acceptance
length (1 + accepted drafts per verifying request-step) and per-position acceptance.
Timings on this shared 2-core machine swing with other jobs: run with
``OMP_WAIT_POLICY=PASSIVE`` and compare the columns of one run only.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/speculative.py [--json]
      (``--platform cuda`` on a GPU machine: the same rows, not measured here)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo-qwen3-tiny"

REPETITIVE = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "- apples\n- pears\n- plums\n- apples\n- pears\n- plums\n- apples\n-",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
]


def truncated_drafter(source: Path, out: Path, num_layers: int) -> Path:
    """``source`` with only its first ``num_layers`` decoder layers (same vocabulary)."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    config["layer_types"] = config.get("layer_types", [])[:num_layers] or None
    if config["layer_types"] is None:
        del config["layer_types"]
    tensors = load_file(source / "model.safetensors")
    keep = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(keep, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def timed(llm: Any, prompts: list[str], max_tokens: int) -> tuple[float, dict[str, Any] | None]:
    from inference_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec = llm.engine.spec
    before = (spec.metrics.num_drafts, spec.metrics.num_accepted_tokens,
              list(spec.metrics.accepted_per_pos)) if spec is not None else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    accept = None
    if spec is not None:
        drafts = spec.metrics.num_drafts - before[0]
        accepted = spec.metrics.num_accepted_tokens - before[1]
        per_pos = [a - b for a, b in zip(spec.metrics.accepted_per_pos, before[2], strict=True)]
        accept = {"acceptance_length": round(1 + accepted / max(drafts, 1), 2),
                  "per_position": [round(n / max(drafts, 1), 2) for n in per_pos]}
    return tokens / elapsed, accept


def compare(name: str, config: dict[str, Any], prompts: list[str], max_tokens: int,
            reps: int, platform: str) -> dict[str, Any]:
    from inference_engine import LLM

    kwargs = dict(dtype="float32", kv_cache_memory=1 << 26, platform=platform,
                  show_progress=False)
    plain = LLM(str(DEMO), **kwargs)
    spec = LLM(str(DEMO), speculative_config=config, **kwargs)
    outputs_equal = (
        [o.outputs[0].token_ids for o in plain.generate(prompts, _greedy(max_tokens),
                                                        use_tqdm=False)]
        == [o.outputs[0].token_ids for o in spec.generate(prompts, _greedy(max_tokens),
                                                          use_tqdm=False)])
    plain_tps, spec_tps, accept = [], [], None
    for _ in range(reps):
        plain_tps.append(timed(plain, prompts, max_tokens)[0])
        tps, accept = timed(spec, prompts, max_tokens)
        spec_tps.append(tps)
    base, fast = statistics.median(plain_tps), statistics.median(spec_tps)
    return {"case": name, "batch": len(prompts), "max_tokens": max_tokens,
            "plain_tok_s": round(base, 1), "spec_tok_s": round(fast, 1),
            "speedup": round(fast / base, 2), **(accept or {}),
            "greedy_outputs_equal": outputs_equal}


def _greedy(max_tokens: int) -> Any:
    from inference_engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--platform", default="cpu", help="cpu, or cuda for a GPU run")
    args = parser.parse_args()
    import torch

    torch.set_flush_denormal(True)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    rows = [compare("ngram k=4", ngram, REPETITIVE[:1], args.max_tokens, args.reps,
                    args.platform),
            compare("ngram k=4", ngram, REPETITIVE, args.max_tokens, args.reps, args.platform)]
    with tempfile.TemporaryDirectory() as tmp:
        drafter = truncated_drafter(DEMO, Path(tmp) / "drafter-1layer", 1)
        for label, model in (("draft_model k=3 (demo, first layer)", drafter),
                             ("draft_model k=3 (demo drafting itself)", DEMO)):
            config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
            rows.append(compare(label, config, REPETITIVE[:1], args.max_tokens, args.reps,
                                args.platform))
        # No trained EAGLE-3 / DFlash drafter exists for the demo model: random ones in the
        # public layouts measure what drafting costs (acceptance ~0 is expected).
        from inference_engine.speculative.testing import make_dflash_drafter, make_eagle3_drafter

        eagle = make_eagle3_drafter(Path(tmp) / "eagle3", DEMO)
        dflash = make_dflash_drafter(Path(tmp) / "dflash", DEMO, block_size=4,
                                     target_layer_ids=(1, 3))
        for label, method, model in (("eagle3 k=3 (random drafter, cost only)", "eagle3", eagle),
                                     ("dflash b=4 (random drafter, cost only)", "dflash", dflash)):
            config = {"method": method, "model": str(model), "num_speculative_tokens": 3}
            rows.append(compare(label, config, REPETITIVE[:1], args.max_tokens, args.reps,
                                args.platform))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':42} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} "
          f"{'acc. len':>8}  per-position acceptance  greedy equal")
    for r in rows:
        print(f"{r['case']:42} {r['batch']:>5} {r['plain_tok_s']:>11} {r['spec_tok_s']:>10} "
              f"{r['speedup']:>7}x {r.get('acceptance_length', '-'):>8}  "
              f"{r.get('per_position')}  {r['greedy_outputs_equal']}")


if __name__ == "__main__":
    main()
