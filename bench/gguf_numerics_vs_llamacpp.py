"""GGUF numerics: our log-probabilities against llama.cpp's on files it quantized, every type.

Models: a small Qwen3 trained here for a few minutes on the docstrings of some Python
standard library modules (``--model trained``, the default: hidden 256, 4 layers, vocab
2048; ``--model trained-moe``: the same as Qwen3-MoE, 8 experts of 256, 2 per token;
trained weights make the logits a smooth function of the activations, as real models are),
and the random bench model of ``bench/gguf_vs_llamacpp.py`` (``--model random``: hidden 512,
8 layers, matrices N(0, 0.05)), which amplifies any 8-bit rounding that goes the other way
into differences of ~0.1 in the logits. Each is exported to an F32 GGUF, and llama.cpp's own
``llama_model_quantize`` (llama-cpp-python) writes one file per ``LLAMA_FTYPE_MOSTLY_*`` type.
On each file, over a 64-token text (held-out text for the trained model), llama.cpp
(f32 KV cache, flash attention off) and the engine (default ``activations=q8``: llama.cpp's
activation rounding and integer dots; then once more with ``activations=float``) give the
log-softmax at every position; at each position the log-probabilities of llama.cpp's top-5
tokens are compared. Target: within 0.01 at every position. Types llama.cpp will not quantize
(without an importance matrix) or that we do not load are reported as such, with the reason.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/gguf_numerics_vs_llamacpp.py
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import torch
import transformers
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T
from gguf_vs_llamacpp import (  # the same model, runner and log-prob readers
    VOCAB,
    build_model,
    find_llamacpp_python,
    log_softmax,
    run_llamacpp,
)
from inference_engine import LLM, SamplingParams
from inference_engine.testing import SAMPLE_TEXT, train_tiny_tokenizer
from inference_engine_gguf.export import export_to_gguf

FTYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q2_K_S", "Q3_K_S",
          "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL",
          "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ1_S", "TQ1_0", "TQ2_0", "MXFP4_MOE"]
TOP = 5
TARGET = 0.01


TRAINED_VOCAB = 2048
# Modules whose docstrings are the training text: natural English that only changes with the
# Python version (the project's own docs change with every commit).
CORPUS_MODULES = (
    "argparse", "collections", "json", "logging", "textwrap", "email.message", "http.client",
    "urllib.parse", "pathlib", "subprocess", "threading", "asyncio.events", "unittest.case",
    "decimal", "fractions", "statistics", "datetime", "calendar", "difflib", "shutil",
    "tarfile", "zipfile", "csv", "configparser", "string", "re", "functools", "itertools",
    "heapq", "bisect", "random", "inspect", "typing", "dataclasses", "enum", "contextlib",
    "tempfile", "glob", "fnmatch", "socket", "ssl", "smtplib", "ftplib", "pickle", "copy",
    "pprint", "doctest", "pdb", "cmd", "codecs", "locale", "gettext", "optparse", "getopt",
    "sched", "queue", "weakref", "abc", "io", "os", "sys")


def corpus_text() -> str:
    """The docstrings of :data:`CORPUS_MODULES`' own functions and classes (~390 KB)."""
    docs = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            if ((inspect.isfunction(obj) or inspect.isclass(obj))
                    and getattr(obj, "__module__", None) == module.__name__):
                doc = inspect.getdoc(obj)
                if doc:
                    docs.append(doc)
        if module.__doc__:
            docs.append(inspect.cleandoc(module.__doc__))
    return "\n\n".join(docs)


def trained_model(steps: int, moe: bool = False, seed: int = 0
                  ) -> tuple[transformers.PreTrainedModel, object, str]:
    """A Qwen3 (hidden 256, 4 layers, 4 / 2 heads of 64, MLP 768, vocab 2048), or with
    ``moe`` a Qwen3-MoE (8 experts of width 256, 2 per token), trained on
    :func:`corpus_text` for ``steps`` AdamW steps of 8 x 128 tokens; also returns the
    held-out last 5% of the text."""
    text = corpus_text()
    split = int(len(text) * 0.95)
    tokenizer = train_tiny_tokenizer(TRAINED_VOCAB, texts=text[:split].split("\n\n"))
    params = dict(
        vocab_size=TRAINED_VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if moe:
        config = transformers.Qwen3MoeConfig(**params, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=256, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(config).float().train()
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**params)).float().train()
    ids = torch.tensor(tokenizer.encode(text[:split]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        offsets = torch.randint(0, len(ids) - 129, (8,), generator=gen)
        batch = torch.stack([ids[o : o + 129] for o in offsets])
        loss = model(batch[:, :-1], labels=batch[:, :-1].clone()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  train step {step}: loss {loss.item():.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval(), tokenizer, text[split:]


def our_logprobs(llm: LLM, tokens: list[int], vocab: int) -> np.ndarray:
    """``[n, vocab]`` log-softmax at every position (prompt logprobs, then the last position's)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab, logprobs=vocab)
    out = llm.generate({"prompt_token_ids": tokens}, params, use_tqdm=False)[0]
    rows = [out.prompt_logprobs[i] for i in range(1, len(tokens))] + [out.outputs[0].logprobs[0]]
    table = np.full((len(rows), vocab), -np.inf)
    for r, entry in enumerate(rows):
        for tok, lp in entry.items():
            table[r, tok] = lp.logprob if hasattr(lp, "logprob") else lp
    return table


def file_types(path: str) -> str:
    """The GGML types of the file's 2-D tensors, most common first (``Q4_1 x50, Q6_K x1``)."""
    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) > 1)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def top_diff(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position: max |ours - ref| over ref's top-5 tokens."""
    top = np.argsort(-ref, axis=-1)[:, :TOP]
    return np.abs(np.take_along_axis(ours, top, -1) - np.take_along_axis(ref, top, -1)).max(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("trained", "trained-moe", "random"),
                        default="trained")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=8, help="layers of the random model")
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--types", default=",".join(FTYPES), help="comma-separated ftypes")
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    python = find_llamacpp_python(args.llamacpp_python)
    if python is None:
        sys.exit("llama-cpp-python is not importable (here, in $LLAMACPP_PYTHON or "
                 "/work/llamacpp-venv): this comparison needs it")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as work:
        if args.model.startswith("trained"):
            hf, tokenizer, held_out = trained_model(args.train_steps, args.model == "trained-moe")
            vocab, text = TRAINED_VOCAB, tokenizer.encode(held_out)[: args.positions]
        else:
            hf, tokenizer = build_model(args.layers)
            vocab, text = VOCAB, tokenizer.encode(" ".join(SAMPLE_TEXT))[: args.positions]
        f32 = os.path.join(work, "model-f32.gguf")
        export_to_gguf(hf, tokenizer, f32, T.F32, extra_control_tokens=vocab - len(tokenizer))
        del hf
        for ftype in args.types.split(","):
            row: dict[str, object] = {"ftype": ftype}
            rows.append(row)
            path = os.path.join(work, f"model-{ftype}.gguf")
            try:
                run_llamacpp(python, {"op": "quantize", "src": f32, "dst": path, "ftype": ftype},
                             work)
            except RuntimeError as e:
                row["status"] = "llama.cpp did not quantize it: " + str(e).splitlines()[-1][:120]
                print(ftype, row["status"], flush=True)
                continue
            row["types"] = file_types(path)
            npy = os.path.join(work, "logits.npy")
            run_llamacpp(python, {"op": "logits", "model": path, "tokens": text,
                                  "out_npy": npy}, work)
            ref = log_softmax(np.load(npy))
            for mode in ("q8", "float"):
                try:
                    llm = LLM(path, dtype="float32", show_progress=False,
                              enable_prefix_caching=False, quant_options={"activations": mode})
                except Exception as e:  # noqa: BLE001 - reported, the next type runs
                    if "is not supported" not in str(e):
                        raise
                    row["status"] = f"not loaded: {str(e).split(' is not supported')[0]}"
                    break
                ours = our_logprobs(llm, text, vocab)
                del llm
                diff = top_diff(ours, ref)
                row[f"max top-5 |dlogprob| ({mode})"] = float(diff.max())
                row[f"positions within {TARGET} ({mode})"] = (
                    f"{int((diff <= TARGET).sum())}/{len(diff)}")
                row[f"top-1 agreement ({mode})"] = float(
                    (ours.argmax(-1) == ref.argmax(-1)).mean())
            else:
                row["status"] = ("ok" if row["max top-5 |dlogprob| (q8)"] <= TARGET
                                 else f"over {TARGET}")
            print(json.dumps(row), flush=True)
    print(f"\n| ftype | tensor types | max top-5 |Δ logprob| q8 (float) | positions ≤ {TARGET} q8 "
          "| top-1 agreement q8 | status |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "max top-5 |dlogprob| (q8)" not in r:
            print(f"| {r['ftype']} | {r.get('types', '')} | | | | {r['status']} |")
            continue
        print(f"| {r['ftype']} | {r['types']} | {r['max top-5 |dlogprob| (q8)']:.2e} "
              f"({r['max top-5 |dlogprob| (float)']:.2e}) | {r[f'positions within {TARGET} (q8)']}"
              f" | {r['top-1 agreement (q8)']:.3f} | {r['status']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
