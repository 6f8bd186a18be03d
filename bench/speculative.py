"""Speculative decoding on CPU: acceptance length and speed-up against the same engine
without speculation, side by side in one process (issue 27).

Target: the committed demo model (models/demo-qwen3-tiny, trained Qwen3, 2M parameters,
float32). Cases, each timed against plain decoding alternately
(median of ``--reps`` runs, after one warm-up run each):

* ``ngram``: prompt lookup (k=4, n-grams of 2..4) on a repetitive workload (numbered lists,
  repeated code lines), greedy, ``ignore_eos``, at batch 1 and batch 4.
* ``draft_model``, on demo-corpus chats (prompts rendered as the server renders them, fresh
  ones the demo model was not trained on; one request at a time, up to EOS), greedy and
  temperature 0.8 (seeded), k=3, with two drafters of one decoder layer: the demo model cut
  to its first layer as is, and the same after a few minutes of distillation from the demo
  model on the demo corpus (``bench/train_draft_model.py``, trained here when missing and
  cached under ``~/.cache/inference-engine/bench/``); at temperature 0.8 also the distilled
  drafter with ``draft_sample_method: probabilistic`` (drafts drawn from its q).
* ``draft_model (self)``: the demo model drafting for itself, an upper bound on
  acceptance (every greedy draft is the target's own pick) that shows what the drafter's
  forwards cost.
* ``eagle3`` / ``dflash``: random drafters in the public checkpoint layouts (no trained one
  exists for the demo model), greedy on the repetitive prompt: what drafting costs,
  acceptance near zero by construction.

Each row reports output tok/s with and without speculation, the speed-up, the acceptance
length (1 + accepted drafts per verifying request-step) and per-position acceptance.
Timings on this shared 2-core machine swing with other jobs: run with
``OMP_WAIT_POLICY=PASSIVE`` and compare the columns of one run only.

Each row also reports the process CPU milliseconds per output token of both engines (the
machine is shared: CPU time is less swayed by other jobs than wall time).

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/speculative.py [--json] [--cases ngram,draft]
      (``--platform cuda`` on a GPU machine: the same rows, not measured here)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def chat_prompts(num: int, seed: int = 2027) -> list[str]:
    """Fresh demo-corpus prompts (a seed the demo model was not trained on), rendered with
    the demo chat template as the server renders them."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "scripts" / "train_demo_model.py"
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    trainer = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_demo_model", trainer)
    spec.loader.exec_module(trainer)
    examples = trainer.CorpusGenerator(seed).examples(num)
    return trainer.render_prompts(examples)


def _params(temperature: float, max_tokens: int, ignore_eos: bool, seed: int | None) -> Any:
    from inference_engine import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                          seed=seed)


def run_workload(llm: Any, prompts: list[str], temperature: float, max_tokens: int,
                 one_at_a_time: bool) -> list[list[int]]:
    """Output token ids of ``prompts``: one batch (repetitive text, ``ignore_eos``) or one
    request at a time up to EOS (chats); sampled requests are seeded per prompt."""
    def params(i: int) -> Any:
        return _params(temperature, max_tokens, ignore_eos=not one_at_a_time,
                       seed=None if temperature == 0 else 1000 + i)

    if one_at_a_time:
        return [llm.generate([p], params(i), use_tqdm=False)[0].outputs[0].token_ids
                for i, p in enumerate(prompts)]
    outs = llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def timed(llm: Any, prompts: list[str], temperature: float, max_tokens: int,
          one_at_a_time: bool) -> tuple[float, float, dict[str, Any] | None]:
    """(output tok/s wall, process CPU ms per output token, acceptance figures)."""
    spec = llm.engine.spec
    before = (spec.metrics.num_drafts, spec.metrics.num_accepted_tokens,
              list(spec.metrics.accepted_per_pos)) if spec is not None else None
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = run_workload(llm, prompts, temperature, max_tokens, one_at_a_time)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o) for o in outs)
    accept = None
    if spec is not None:
        drafts = spec.metrics.num_drafts - before[0]
        accepted = spec.metrics.num_accepted_tokens - before[1]
        per_pos = [a - b for a, b in zip(spec.metrics.accepted_per_pos, before[2], strict=True)]
        accept = {"acceptance_length": round(1 + accepted / max(drafts, 1), 2),
                  "per_position": [round(n / max(drafts, 1), 2) for n in per_pos]}
    return tokens / elapsed, 1000 * cpu / max(tokens, 1), accept


def compare(name: str, config: dict[str, Any], prompts: list[str], max_tokens: int,
            reps: int, platform: str, temperature: float = 0.0,
            one_at_a_time: bool = False) -> dict[str, Any]:
    from inference_engine import LLM

    kwargs = dict(dtype="float32", kv_cache_memory=1 << 26, platform=platform,
                  show_progress=False)
    plain = LLM(str(DEMO), **kwargs)
    spec = LLM(str(DEMO), speculative_config=config, **kwargs)
    # Greedy: token for token; temperature > 0: seeded requests, token for token too.
    outputs_equal = (run_workload(plain, prompts, temperature, max_tokens, one_at_a_time)
                     == run_workload(spec, prompts, temperature, max_tokens, one_at_a_time))
    plain_tps, spec_tps, plain_cpu, spec_cpu, accept = [], [], [], [], None
    for _ in range(reps):
        tps, cpu, _ = timed(plain, prompts, temperature, max_tokens, one_at_a_time)
        plain_tps.append(tps)
        plain_cpu.append(cpu)
        tps, cpu, accept = timed(spec, prompts, temperature, max_tokens, one_at_a_time)
        spec_tps.append(tps)
        spec_cpu.append(cpu)
    base, fast = statistics.median(plain_tps), statistics.median(spec_tps)
    base_cpu, fast_cpu = statistics.median(plain_cpu), statistics.median(spec_cpu)
    return {"case": name, "batch": 1 if one_at_a_time else len(prompts),
            "temperature": temperature, "max_tokens": max_tokens,
            "plain_tok_s": round(base, 1), "spec_tok_s": round(fast, 1),
            "speedup": round(fast / base, 2),
            "plain_cpu_ms_per_tok": round(base_cpu, 2), "spec_cpu_ms_per_tok": round(fast_cpu, 2),
            "cpu_speedup": round(base_cpu / fast_cpu, 2), **(accept or {}),
            "outputs_equal": outputs_equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--platform", default="cpu", help="cpu, or cuda for a GPU run")
    parser.add_argument("--cases", default="ngram,draft,hidden",
                        help="comma-separated subset of ngram, draft, hidden (eagle3/dflash)")
    parser.add_argument("--num-chats", type=int, default=4,
                        help="demo-corpus chats per draft_model row")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    import torch

    torch.set_flush_denormal(True)
    rows = []
    if "ngram" in cases:
        ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                 "prompt_lookup_max": 4}
        rows += [compare("ngram k=4", ngram, REPETITIVE[:1], args.max_tokens, args.reps,
                         args.platform),
                 compare("ngram k=4", ngram, REPETITIVE, args.max_tokens, args.reps,
                         args.platform)]
    with tempfile.TemporaryDirectory() as tmp:
        if "draft" in cases:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from train_draft_model import ensure_draft_model

            trained = ensure_draft_model()
            cut = truncated_drafter(DEMO, Path(tmp) / "drafter-1layer", 1)
            chats = chat_prompts(args.num_chats)
            drafters = [("draft_model k=3 (demo's first layer, untrained)", cut, "greedy"),
                        ("draft_model k=3 (1 layer, distilled)", trained, "greedy"),
                        ("draft_model k=3 (demo drafting itself)", DEMO, "greedy")]
            for temperature in (0.0, 0.8):
                # Sampled requests: also drafts drawn from q (draft_sample_method).
                extra = [] if temperature == 0 else [
                    ("draft_model k=3 (1 layer, distilled, probabilistic)", trained,
                     "probabilistic")]
                for label, model, method in drafters + extra:
                    config = {"method": "draft_model", "model": str(model),
                              "num_speculative_tokens": 3, "draft_sample_method": method}
                    rows.append(compare(label, config, chats, 256, args.reps, args.platform,
                                        temperature=temperature, one_at_a_time=True))
        if "hidden" in cases:
            # No trained EAGLE-3 / DFlash drafter exists for the demo model: random ones in
            # the public layouts measure what drafting costs (acceptance ~0 is expected).
            from inference_engine.speculative.testing import (
                make_dflash_drafter,
                make_eagle3_drafter,
            )

            eagle = make_eagle3_drafter(Path(tmp) / "eagle3", DEMO)
            dflash = make_dflash_drafter(Path(tmp) / "dflash", DEMO, block_size=4,
                                         target_layer_ids=(1, 3))
            for label, method, model in (
                    ("eagle3 k=3 (random drafter, cost only)", "eagle3", eagle),
                    ("dflash b=4 (random drafter, cost only)", "dflash", dflash)):
                config = {"method": method, "model": str(model), "num_speculative_tokens": 3}
                rows.append(compare(label, config, REPETITIVE[:1], args.max_tokens, args.reps,
                                    args.platform))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':48} {'batch':>5} {'temp':>4} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'speed-up':>8} {'CPU ms/tok plain/spec':>21} {'CPU speed-up':>12} {'acc. len':>8}"
          "  per-position acceptance  outputs equal")
    for r in rows:
        cpu = f"{r['plain_cpu_ms_per_tok']} / {r['spec_cpu_ms_per_tok']}"
        print(f"{r['case']:48} {r['batch']:>5} {r['temperature']:>4} {r['plain_tok_s']:>11} "
              f"{r['spec_tok_s']:>10} {r['speedup']:>7}x {cpu:>21} {r['cpu_speedup']:>11}x "
              f"{r.get('acceptance_length', '-'):>8}  {r.get('per_position')}  "
              f"{r['outputs_equal']}")


if __name__ == "__main__":
    main()
