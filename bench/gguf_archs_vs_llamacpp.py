"""GGUF per architecture: raw float32 logits of ours vs llama.cpp vs transformers (issue 7).

For each architecture a small random float32 transformers model (hidden 256,
``--layers`` layers, the tiny test tokenizer's vocab) is exported to an F32 GGUF
by ``inference_engine_gguf.export``. Over a ``--tokens``-token text, measured at
every position and every vocab entry:

* max |logit ours - llama.cpp|, max |logit ours - transformers|,
  max |logit llama.cpp - transformers|, and top-1 agreement of ours with llama.cpp;
* ours: ``LLM(path, dtype="float32")`` and one prefill step of the loaded model
  (``our_raw_logits`` of bench/gguf_vs_llamacpp.py);
* llama.cpp: ``Llama(..., logits_all=True, type_k=0, type_v=0, flash_attn=False)``
  through bench/_llamacpp_runner.py under llama-cpp-python's interpreter.

If llama.cpp refuses a file, its key log line goes into the table and the bench
moves on. With ``--converter DIR`` (a llama.cpp checkout holding
``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``, e.g. from the
llama-cpp-python sdist's ``vendor/llama.cpp``), the saved transformers model is
also converted by llama.cpp's own converter (``--outtype f32``; its BPE
pre-tokenizer check is told ``default``, as our tiny tokenizer is no released
one), and ours and llama.cpp are compared on that file too.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/gguf_archs_vs_llamacpp.py \\
          [--converter /tmp/lcp-sdist/llama_cpp_python-0.3.36/vendor/llama.cpp]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf.constants import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_vs_llamacpp import find_llamacpp_python, our_raw_logits, run_llamacpp  # noqa: E402
from inference_engine import LLM  # noqa: E402
from inference_engine.testing import SAMPLE_TEXT, train_tiny_tokenizer  # noqa: E402
from inference_engine_gguf.export import export_to_gguf  # noqa: E402

SMALL_KV = 1 << 22
COMMON = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=512)

# model_type -> (config class, model class, config overrides); MoE settings as in
# plugins/gguf/tests/test_moe_parity.py.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=512)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=512)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=512, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        norm_topk_prob=True)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.09,
        logits_scaling=2.0)),
    # norm_topk_prob=False: transformers' DeepseekV2 ignores it (llama.cpp and ours do not).
    # q_lora_rank set (DeepSeek-V2 proper): this llama.cpp takes a model for V2-Lite (no
    # q_lora_rank key) only by its layer count (26 or 27, or 48 with a 128256 vocab).
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=256,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=64, head_dim=32, routed_scaling_factor=1.5,
        topk_method="greedy", norm_topk_prob=False)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=256, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=True, num_nextn_predict_layers=1)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, rotary_dim=32)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=64))),
    # gpt-oss with plain RoPE: the rest of the architecture without YaRN's correction range
    # (gpt-oss's reference YaRN does not round it, llama.cpp's does).
    "gpt_oss-rope_default": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, rope_parameters=dict(rope_type="default", rope_theta=150000.0))),
}
# What released config.json files say and transformers' configs drop (our exporter fills
# them in too), written into the saved model for llama.cpp's converter.
RELEASED_CONFIG = {"deepseek_v2": {"scoring_func": "softmax"},
                   "minimax_m2": {"scoring_func": "sigmoid"}}
# Added tokens llama.cpp's GLM vocab code looks up by name.
GLM_SPECIAL = ["[gMASK]", "<sop>", "<|user|>", "<|observation|>"]

# llama.cpp's converter, run as a module so its BPE pre-tokenizer check can be answered.
# sentencepiece is not installed here, and our tokenizer has no tokenizer.model: the
# sentencepiece vocab path says so (FileNotFoundError), and Llama falls back to gpt2 BPE.
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as c
from conversion.base import TextModel
def no_sentencepiece(self):
    raise FileNotFoundError("no tokenizer.model")
TextModel._create_vocab_sentencepiece = no_sentencepiece
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outtype", "f32", "--outfile", sys.argv[3]]
c.main()
"""


def make_model(model_type: str, tokenizer, layers: int, std: float, seed: int = 0):
    """A random float32 model: matrices N(0, std) (``std`` 0: transformers' own init), norms
    U(0.8, 1.2), biases / sinks / expert score biases N(0, 0.1)."""
    config_name, model_name, overrides = ARCHS[model_type]
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        raise RuntimeError(f"transformers {transformers.__version__} has no {model_name}")
    params = {**COMMON, "num_hidden_layers": layers, "vocab_size": len(tokenizer),
              "tie_word_embeddings": False, "eos_token_id": tokenizer.eos_token_id,
              "bos_token_id": None, "pad_token_id": tokenizer.pad_token_id, **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**params)).float().eval()
    if std > 0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std)
                elif "norm" in name:
                    p.uniform_(0.8, 1.2)
                else:
                    p.normal_(0.0, 0.1)
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.1)
    return model


def key_line(text: str) -> str:
    """The line of a llama.cpp / converter log that says why it stopped."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for marker in ("error loading model", "llama_model_load: error", "fatal error", "GGML_ASSERT",
                   "error:", "Error", "Exception", "failed"):
        hits = [ln for ln in lines if marker in ln]
        if hits:
            return hits[0][:200]
    return lines[-1][:200] if lines else "(no output)"


def llamacpp_logits(python: str, path: str, tokens: list[int], work: str) -> np.ndarray:
    """llama.cpp's ``[n, vocab]`` logits, or RuntimeError carrying its refusal's key line."""
    npy = os.path.join(work, "logits.npy")
    job = {"op": "logits", "model": path, "tokens": tokens, "out_npy": npy}
    try:
        run_llamacpp(python, job, work)
    except RuntimeError:
        try:  # again with llama.cpp's log on, to say why
            run_llamacpp(python, {**job, "verbose": True}, work)
        except RuntimeError as err:
            raise RuntimeError(key_line(str(err).split("\n", 1)[-1])) from None
    return np.load(npy).astype(np.float64)


def ours_logits(path: str, tokens: list[int]) -> np.ndarray:
    llm = LLM(path, dtype="float32", show_progress=False, enable_prefix_caching=False,
              kv_cache_memory=SMALL_KV)
    try:
        return our_raw_logits(llm, tokens)
    finally:
        del llm
        gc.collect()


def convert_with_llamacpp(converter: str, model_dir: str, out: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.path.join(converter, "gguf-py")}
    proc = subprocess.run([sys.executable, "-c", CONVERT, converter, model_dir, out],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(key_line(proc.stderr))


def same_tensors(a: str, b: str) -> bool:
    """Whether two GGUF files hold the same tensor names, types and bytes (metadata aside)."""
    from gguf import GGUFReader

    ta = {t.name: t for t in GGUFReader(a).tensors}
    tb = {t.name: t for t in GGUFReader(b).tensors}
    return ta.keys() == tb.keys() and all(
        ta[n].tensor_type == tb[n].tensor_type
        and np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data)) for n in ta)


def measure(model_type: str, args, tokenizer, tokens: list[int], python: str | None,
            work: str) -> dict:
    row: dict = {"arch": model_type}
    if model_type == "glm4_moe":  # appended after the vocab: the text's tokens stay the same
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": GLM_SPECIAL})
    model = make_model(model_type, tokenizer, args.layers, args.std)
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].double().numpy()
    row["max |logit| (transformers)"] = float(np.abs(ref).max())
    path = os.path.join(work, f"{model_type}-ours-f32.gguf")
    export_to_gguf(model, tokenizer, path, T.F32)
    files = {"ours": path}
    if args.converter:
        model_dir = os.path.join(work, f"{model_type}-hf")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**config, **RELEASED_CONFIG.get(model_type, {})}, f, indent=2)
        conv = os.path.join(work, f"{model_type}-convert-f32.gguf")
        try:
            convert_with_llamacpp(args.converter, model_dir, conv)
            files["convert"] = conv
            row["convert: same tensors as ours"] = same_tensors(path, conv)
        except RuntimeError as err:
            row["convert: error"] = f"convert_hf_to_gguf: {err}"
    del model
    for label, file in files.items():
        try:
            ours = ours_logits(file, tokens)
            row[f"{label}: max |ours - transformers|"] = float(np.abs(ours - ref).max())
        except Exception as err:  # noqa: BLE001 - reported in the table
            ours = None
            row[f"{label}: error"] = f"ours: {type(err).__name__}: {str(err)[:160]}"
        if python is None:
            continue
        try:
            theirs = llamacpp_logits(python, file, tokens, work)
        except RuntimeError as err:
            row.setdefault(f"{label}: error", f"llama.cpp: {err}")
            continue
        row[f"{label}: max |llama.cpp - transformers|"] = float(np.abs(theirs - ref).max())
        if ours is not None:
            row[f"{label}: max |ours - llama.cpp|"] = float(np.abs(ours - theirs).max())
            row[f"{label}: top-1 ours = llama.cpp"] = float(
                (ours.argmax(-1) == theirs.argmax(-1)).mean())
    return row


def print_table(rows: list[dict], n: int) -> None:
    labels = ["ours"] + (["convert"] if any(k.startswith("convert") for r in rows for k in r)
                         else [])
    for label in labels:
        same = ", ".join(f"{r['arch']} {'yes' if r.get('convert: same tensors as ours') else 'no'}"
                         for r in rows)
        title = ("our exporter's F32 file" if label == "ours" else
                 f"llama.cpp convert_hf_to_gguf.py's F32 file (same tensors as ours: {same})")
        print(f"\n{title}: max abs logit difference over {n} positions x vocab")
        print("| arch | max\\|logit\\| | ours − llama.cpp | ours − transformers | "
              "llama.cpp − transformers | top-1 ours = llama.cpp |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            def cell(key: str, fmt: str = ".2e", r=r, label=label) -> str:
                v = r.get(f"{label}: {key}")
                return "—" if v is None else f"{v:{fmt}}"
            line = (f"| {r['arch']} | {r['max |logit| (transformers)']:.2f} | "
                    f"{cell('max |ours - llama.cpp|')} | {cell('max |ours - transformers|')} | "
                    f"{cell('max |llama.cpp - transformers|')} | "
                    f"{cell('top-1 ours = llama.cpp', '.3f')} |")
            print(line)
            if f"{label}: error" in r:
                print(f"|   {r['arch']} error: {r[f'{label}: error']} |||||")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated model types")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48, help="text length in tokens")
    parser.add_argument("--std", type=float, default=0.05,
                        help="std of the random matrices (0: transformers' default init)")
    parser.add_argument("--llamacpp-python", default=None,
                        help="interpreter with llama-cpp-python installed")
    parser.add_argument("--converter", default=None,
                        help="llama.cpp dir with convert_hf_to_gguf.py (optional second file)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    python = find_llamacpp_python(args.llamacpp_python)
    print(f"llama.cpp side: {python or 'llama-cpp-python not importable: SKIPPED'}")
    tokenizer = train_tiny_tokenizer()
    tokens = tokenizer.encode(" ".join(SAMPLE_TEXT))[: args.tokens]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for model_type in args.archs.split(","):
            print(f"{model_type} ...", flush=True)
            try:
                rows.append(measure(model_type, args, tokenizer, tokens, python, work))
            except Exception as err:  # noqa: BLE001 - one arch failing does not stop the rest
                rows.append({"arch": model_type, "max |logit| (transformers)": float("nan"),
                             "ours: error": f"{type(err).__name__}: {str(err)[:160]}"})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{len(tokens)} tokens, {args.layers} layers, hidden 256, vocab {len(tokenizer)}, "
          f"std {args.std or 'transformers default'}")
    print_table(rows, len(tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": len(tokens), "layers": args.layers, "std": args.std,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
