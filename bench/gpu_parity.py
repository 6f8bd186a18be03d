"""Greedy parity of every registered architecture on one device, in float32 and bfloat16.

For each architecture of inference-engine-models, the tiny random model its tests
use (``testing_parity.TINY_CONFIGS``: 2 layers, hidden 64; MoE: 8 experts, top-2)
is saved with the tiny tokenizer. transformers' greedy continuations of a few
prompts, on the CPU in float32, are the reference; ours come from
``LLM(path, platform=--device, dtype=...)``. Tokens are judged by the near-tie
rule of ``testing_parity.assert_greedy_matches``: a continuation may leave the
reference only where the reference's top-2 logits are within ``--tie`` (and
both tokens are those two); after that the continuations are not compared.

Where an MoE model's tokens differ, the diverging position is replayed on both
sides with forward hooks (transformers: its router modules; ours: the router
projection and the experts' routed ids of each ``SparseMoeBlock``) and each
layer's routed expert ids and top-k margin (the gap between the k-th and
(k+1)-th choice score) are recorded, with the first layer whose ids differ.

Output: one JSON line per (architecture, dtype) on stdout, then a summary line;
``--out`` gets the same as one JSON document (rewritten after every case).

Run:  .venv/bin/python bench/gpu_parity.py --device cpu
      python bench/gpu_parity.py --device cuda --out $OUT/gpu_parity.json
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from inference_engine import LLM, SamplingParams
from inference_engine.layers.moe import SparseMoeBlock
from inference_engine.layers.moe.router import RouterSpec
from inference_engine.plugins import get_plugins
from inference_engine.testing import train_tiny_tokenizer
from inference_engine.testing_parity import (
    MOE_CONFIGS,
    PARITY_NEW_TOKENS,
    PARITY_PROMPTS,
    TINY_CONFIGS,
    Divergence,
    first_divergence,
    hf_greedy,
    randomize,
)

PROMPTS = PARITY_PROMPTS
NEW_TOKENS = PARITY_NEW_TOKENS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LAYER = re.compile(r"layers\.(\d+)\.")


# --------------------------------------------------------------------------- #
# The models and the reference.
# --------------------------------------------------------------------------- #


def save_tiny_model(arch: str, tokenizer: Any, path: Path) -> Any:
    """Save ``arch``'s tiny random model (float32) and the tokenizer; returns the HF model."""
    config = TINY_CONFIGS[arch](len(tokenizer))
    config.eos_token_id, config.pad_token_id, config.bos_token_id = (
        tokenizer.eos_token_id, tokenizer.pad_token_id, None)
    torch.manual_seed(0)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config), std=0.1)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf.config._attn_implementation = "eager"
    hf.generation_config.eos_token_id = None  # like ignore_eos
    return hf


def registered_architectures() -> dict[str, str]:
    """Our tiny-config key -> its model class name, for the classes plugins register."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(get_plugins().registry.names("models"))
    out = {}
    for arch, make_config in TINY_CONFIGS.items():
        cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[make_config(256).model_type]
        if cls_name in names:
            out[arch] = cls_name
    return out


# --------------------------------------------------------------------------- #
# Routed experts at one position, both sides.
# --------------------------------------------------------------------------- #


def _layer_index(name: str) -> int:
    found = _LAYER.search(name)
    return int(found.group(1)) if found else -1


def choice_margin(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> float:
    """Gap between the k-th and (k+1)-th choice score of one token's router ``logits [E]``
    (scores as ``route`` ranks them; group limits ignored)."""
    logits = logits.float()
    if spec.scoring == "topk_softmax":
        choice = logits
    else:
        choice = logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()
        if bias is not None:
            choice = choice + bias.float()
    top = choice.topk(spec.top_k + 1).values if spec.top_k < choice.numel() else None
    return float(top[-2] - top[-1]) if top is not None else float("inf")


def hf_routing(model: Any, token_ids: list[int]) -> dict[int, tuple[list[int], torch.Tensor]]:
    """layer -> (routed expert ids, router logits) of the last token, from transformers."""
    found: dict[int, tuple[list[int], torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if "router" not in type(module).__name__.lower():
            continue

        def hook(_m: Any, _args: Any, out: Any, layer: int = _layer_index(name)) -> None:
            # transformers v5 routers return (router_logits [T, E], weights, ids [T, k]).
            logits, ids = out[0], out[-1]
            found[layer] = (sorted(ids.reshape(-1, ids.shape[-1])[-1].tolist()),
                            logits.reshape(-1, logits.shape[-1])[-1].detach().float().cpu())

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return found


def our_routing(llm: LLM, token_ids: list[int]
                ) -> tuple[dict[int, tuple[list[int], torch.Tensor]], dict[int, Any]]:
    """layer -> (routed expert ids, router logits) of the last token through our engine;
    also layer -> (RouterSpec, correction bias) for the margins.

    The context runs as one prompt with ``prompt_logprobs`` so the step is a prefill
    (eager, never a graph replay) and the hooks see it.
    """
    found: dict[int, tuple[list[int], torch.Tensor]] = {}
    logits_seen: dict[int, torch.Tensor] = {}
    routers: dict[int, Any] = {}
    handles = []
    for name, module in llm.engine.model.named_modules():
        if not isinstance(module, SparseMoeBlock):
            continue
        layer = _layer_index(name)
        bias = module._correction_bias[0]
        routers[layer] = (module.routing, None if bias is None else bias.detach().float().cpu())

        def gate_hook(_m: Any, _args: Any, out: Any, layer: int = layer) -> None:
            logits_seen[layer] = out.reshape(-1, out.shape[-1])[-1].detach().float().cpu()

        def experts_hook(_m: Any, args: Any, layer: int = layer) -> None:
            ids = args[2]  # FusedMoE.forward(x, weights, ids [T, k])
            found[layer] = (sorted(ids[-1].tolist()), logits_seen.get(layer))

        handles.append(getattr(module, module.gate_name).register_forward_hook(gate_hook))
        handles.append(module.experts.register_forward_pre_hook(experts_hook))
    try:
        llm.generate({"prompt_token_ids": token_ids},
                     SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                     use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return found, routers


def expert_diff(hf: Any, llm: LLM, context: list[int]) -> dict[str, Any]:
    """Per MoE layer: both sides' routed ids and margins at the last token of ``context``."""
    ref = hf_routing(hf, context)
    ours, routers = our_routing(llm, context)
    layers = []
    first_differing = None
    for layer in sorted(set(ref) | set(ours)):
        ref_ids, ref_logits = ref.get(layer, (None, None))
        our_ids, our_logits = ours.get(layer, (None, None))
        spec, bias = routers.get(layer, (None, None))
        row: dict[str, Any] = {"layer": layer, "ref_ids": ref_ids, "our_ids": our_ids,
                               "same": ref_ids == our_ids}
        if spec is not None:
            if ref_logits is not None:
                row["ref_margin"] = choice_margin(ref_logits, spec, bias)
            if our_logits is not None:
                row["our_margin"] = choice_margin(our_logits, spec, bias)
            if ref_logits is not None and our_logits is not None:
                row["max_logit_diff"] = float((ref_logits - our_logits).abs().max())
        if not row["same"] and first_differing is None:
            first_differing = layer
        layers.append(row)
    return {"first_differing_layer": first_differing, "layers": layers}


# --------------------------------------------------------------------------- #
# One (architecture, dtype) case.
# --------------------------------------------------------------------------- #


def _divergence_json(prompt: int, d: Divergence) -> dict[str, Any]:
    return {"prompt": prompt, "position": d.position, "ours": d.ours, "ref": d.ref,
            "gap": d.gap, "top2_ids": list(d.top2_ids), "near_tie": d.is_near_tie}


def run_case(arch: str, dtype: str, path: Path, hf: Any, prompt_ids: list[list[int]],
             refs: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    llm = LLM(str(path), platform=args.device, dtype=dtype, show_progress=False,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=8,
              enforce_eager=args.enforce_eager)
    loaded = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    tie = args.tie if dtype == "float32" else args.tie_bf16
    per_prompt, divergences = [], []
    for i, (ids, out, ref) in enumerate(zip(prompt_ids, outs, refs, strict=True)):
        d = first_divergence(hf, ids, out.outputs[0].token_ids, ref, tie)
        per_prompt.append("match" if d is None else "near_tie" if d.is_near_tie else "diverged")
        if d is not None:
            divergences.append((i, d))
    status = ("diverged" if "diverged" in per_prompt
              else "accepted_near_tie" if "near_tie" in per_prompt else "match")
    result: dict[str, Any] = {"arch": arch, "dtype": dtype, "device": args.device,
                              "status": status, "tie": tie, "per_prompt": per_prompt}
    # The first hard divergence, else the first accepted near-tie.
    first = next(((i, d) for i, d in divergences if not d.is_near_tie), None) or (
        divergences[0] if divergences else None)
    result["first_divergence"] = None if first is None else _divergence_json(*first)
    result["experts"] = None
    if first is not None and arch in MOE_CONFIGS:
        i, d = first
        context = prompt_ids[i] + refs[i][: d.position]
        result["experts"] = expert_diff(hf, llm, context)
    result["load_s"] = round(loaded - start, 2)
    result["seconds"] = round(time.perf_counter() - start, 2)
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="our engine's platform: cpu, cuda, ...")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated engine dtypes (the reference is always float32)")
    parser.add_argument("--archs", default="",
                        help=f"comma-separated subset of {','.join(TINY_CONFIGS)} (default: all)")
    parser.add_argument("--out", default="", help="write every result as one JSON file here")
    parser.add_argument("--tie", type=float, default=1e-4,
                        help="near-tie top-2 gap for float32 (the parity tests' value)")
    parser.add_argument("--tie-bf16", type=float, default=5e-2,
                        help="near-tie top-2 gap for bfloat16: the reference stays float32, and "
                             "bf16 weights and activations move these logits by ~1e-2")
    parser.add_argument("--kv-cache-memory", type=int, default=32 << 20, help="bytes")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="skip the remaining cases after this many seconds (0: no limit)")
    args = parser.parse_args()

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"--dtypes: unknown {d!r}; known: {', '.join(DTYPES)}")
    registered = registered_architectures()
    archs = [a.strip() for a in args.archs.split(",") if a.strip()] or list(TINY_CONFIGS)
    for a in archs:
        if a not in TINY_CONFIGS:
            parser.error(f"--archs: unknown {a!r}; known: {', '.join(TINY_CONFIGS)}")
    missing = sorted(set(get_plugins().registry.names("models")) - set(registered.values()))

    torch.set_flush_denormal(True)
    began = time.perf_counter()
    tokenizer = train_tiny_tokenizer()
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    results: list[dict[str, Any]] = []

    def emit(result: dict[str, Any]) -> None:
        results.append(result)
        print(json.dumps(result), flush=True)
        experts = result.get("experts")
        if experts is not None:
            layer = experts["first_differing_layer"]
            where = "no layer" if layer is None else f"layer {layer}"
            print(f"# {result['arch']}/{result['dtype']}: routed experts first differ at {where}",
                  file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"results": results}, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            if args.budget_s and time.perf_counter() - began > args.budget_s:
                for dtype in dtypes:
                    emit({"arch": arch, "dtype": dtype, "device": args.device,
                          "status": "skipped", "reason": "--budget-s spent"})
                continue
            path = Path(tmp) / arch
            try:
                hf = save_tiny_model(arch, tokenizer, path)
                refs = hf_greedy(hf, prompt_ids, NEW_TOKENS)
            except Exception as exc:  # noqa: BLE001 - one broken reference must not stop the rest
                for dtype in dtypes:
                    emit({"arch": arch, "dtype": dtype, "device": args.device, "status": "error",
                          "error": f"reference: {type(exc).__name__}: {exc}"})
                continue
            for dtype in dtypes:
                try:
                    emit(run_case(arch, dtype, path, hf, prompt_ids, refs, args))
                except Exception as exc:  # noqa: BLE001
                    emit({"arch": arch, "dtype": dtype, "device": args.device, "status": "error",
                          "error": f"{type(exc).__name__}: {exc}"})

    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = {
        "summary": True, "device": args.device, "dtypes": dtypes, "counts": counts,
        "diverged": [f"{r['arch']}/{r['dtype']}" for r in results if r["status"] == "diverged"],
        "errors": [f"{r['arch']}/{r['dtype']}" for r in results if r["status"] == "error"],
        "registered_without_tiny_config": missing,
        "seconds": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "summary": summary}, indent=1))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
