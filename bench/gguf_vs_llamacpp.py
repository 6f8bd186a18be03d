"""GGUF: this engine vs llama.cpp (llama-cpp-python) on the same GGUF files.

Model: the issue-3 benchmark architecture (random Qwen3, hidden 512, 8 layers,
8 heads / 4 KV heads, head_dim 64, intermediate 1536, vocab 8192), exported to
an F32 GGUF by ``inference_engine_gguf.export`` and quantized to Q4_K_M by
llama.cpp's own ``llama_model_quantize`` (by our simple exporter when
llama.cpp is missing). Measured:

* next-token logits over a text on the F32 file (and the Q4_K_M file): max abs
  difference of the log-softmax (= logits up to each position's normaliser)
  and top-1 agreement; llama.cpp runs with an f32 KV cache, flash attention off.
  Ours on Q4_K_M runs with the default ``activations=q8`` (llama.cpp's Q8_K
  arithmetic), and once more with ``activations=float`` against transformers;
* decode tokens/s at batch 1 on the Q4_K_M file (ours and llama.cpp);
* total throughput with 16 concurrent sequences (ours batched; llama.cpp's
  Python binding runs one stream at a time, so its figure is its batch-1 rate).

llama-cpp-python may live in another virtualenv (it compiles llama.cpp): the
llama.cpp side runs ``bench/_llamacpp_runner.py`` under ``--llamacpp-python``
(default: this interpreter if it imports llama_cpp, else $LLAMACPP_PYTHON, else
/work/llamacpp-venv/bin/python). Without it the llama.cpp side is skipped, said
so plainly, and our figures are still measured.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/gguf_vs_llamacpp.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf.constants import GGMLQuantizationType as T
from inference_engine import LLM, SamplingParams
from inference_engine.testing import SAMPLE_TEXT, train_tiny_tokenizer
from inference_engine_gguf.export import export_to_gguf
from inference_engine_gguf.quant_method import model_weight_bytes

RUNNER = Path(__file__).with_name("_llamacpp_runner.py")
VOCAB = 8192


def build_model(layers: int, std: float = 0.05) -> transformers.PreTrainedModel:
    """The bench model; matrices drawn from N(0, std), or transformers' own init for std 0."""
    tokenizer = train_tiny_tokenizer()
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    if std > 0:
        with torch.no_grad():  # a wider spread than the default init: decisive next tokens
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, std)
    return model, tokenizer


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    return T.Q6_K if any(k in name for k in ("v_proj", "down_proj", "lm_head")) else T.Q4_K


def with_file_weights(hf: transformers.PreTrainedModel, path: str) -> transformers.PreTrainedModel:
    """A copy of ``hf`` holding the values ``path`` stores (gguf's numpy dequantization),
    found through gguf's own HF->GGML name map (no code of ours involved)."""
    import copy

    import gguf
    from gguf import GGUFReader, quants

    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, hf.config.num_hidden_layers)
    model = copy.deepcopy(hf)
    state = model.state_dict()
    for name in state:
        ggml = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        t = tensors[ggml]
        values = np.array(quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
        state[name] = torch.from_numpy(values).reshape(state[name].shape)
    model.load_state_dict(state)
    return model


def find_llamacpp_python(requested: str | None) -> str | None:
    candidates = [requested] if requested else [
        sys.executable, os.environ.get("LLAMACPP_PYTHON"), "/work/llamacpp-venv/bin/python"]
    for python in candidates:
        if not python or not os.path.exists(python):
            continue
        probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
        if probe.returncode == 0:
            return python
    return None


def run_llamacpp(python: str, job: dict, workdir: str, spinning: bool = False) -> dict:
    """Run one job in llama.cpp's interpreter; ``spinning`` drops ``OMP_WAIT_POLICY`` from
    its environment so its OpenMP threads spin between ops, as they do by default."""
    job_path, out_path = os.path.join(workdir, "job.json"), os.path.join(workdir, "out.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    env = dict(os.environ)
    if spinning:
        env.pop("OMP_WAIT_POLICY", None)
    proc = subprocess.run([python, str(RUNNER), job_path, out_path], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp runner failed ({job['op']}):\n{proc.stderr[-3000:]}")
    with open(out_path) as f:
        return json.load(f)


def our_logprobs(llm: LLM, tokens: list[int]) -> np.ndarray:
    """``[n, vocab]`` log-softmax at every position (prompt logprobs, then the last position's)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=VOCAB, logprobs=VOCAB)
    out = llm.generate({"prompt_token_ids": tokens}, params, use_tqdm=False)[0]
    rows = [out.prompt_logprobs[i] for i in range(1, len(tokens))] + [out.outputs[0].logprobs[0]]
    table = np.full((len(rows), VOCAB), -np.inf)
    for r, entry in enumerate(rows):
        for tok, lp in entry.items():
            table[r, tok] = lp.logprob if hasattr(lp, "logprob") else lp
    return table


def our_raw_logits(llm: LLM, tokens: list[int]) -> np.ndarray:
    """``[n, vocab]`` float32 logits at every position: one prefill step of the loaded model,
    run directly (the engine reports log-probabilities, not logits). The engine is idle,
    so the step may write its K/V into blocks 1.. of the pool."""
    from inference_engine.testing_parity import Seq, make_step

    block_size = llm.engine.runner.block_size
    blocks = list(range(1, 1 + -(-len(tokens) // block_size)))
    ids, positions, metadata = make_step([Seq(list(tokens), 0, blocks)], block_size)
    model = llm.engine.model
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, metadata)).double().numpy()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def ours_decode(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return new_tokens / (time.perf_counter() - start)


def ours_concurrent(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def median(fn, repeats: int, label: str) -> float:
    runs = []
    for r in range(repeats):
        runs.append(fn())
        print(f"  {label} run {r + 1}/{repeats}: {runs[-1]:.1f}", flush=True)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per speed figure (median)")
    parser.add_argument("--llamacpp-python", default=None,
                        help="interpreter with llama-cpp-python installed")
    parser.add_argument("--dtype", default="float32", help="our compute dtype")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--init-std", type=float, default=0.05,
                        help="std of the random matrices; 0: transformers' default init")
    parser.add_argument("--logits-only", action="store_true",
                        help="measure the logit comparisons, skip the speed runs")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    python = find_llamacpp_python(args.llamacpp_python)
    if python is None:
        print("llama-cpp-python is not importable (here, in $LLAMACPP_PYTHON or "
              "/work/llamacpp-venv): the llama.cpp side is SKIPPED; measuring ours only.")
    else:
        print(f"llama.cpp side: {python}")
    results: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory() as work:
        print("building and exporting the model ...", flush=True)
        hf, tokenizer = build_model(args.layers, args.init_std)
        f32 = os.path.join(work, "model-f32.gguf")
        export_to_gguf(hf, tokenizer, f32, T.F32, extra_control_tokens=VOCAB - len(tokenizer))
        q4 = os.path.join(work, "model-q4_k_m.gguf")
        if python is not None:
            run_llamacpp(python, {"op": "quantize", "src": f32, "dst": q4, "ftype": "Q4_K_M"},
                         work)
            results["Q4_K_M file made by"] = "llama.cpp llama_model_quantize"
        else:
            export_to_gguf(hf, tokenizer, q4, q4_k_m, extra_control_tokens=VOCAB - len(tokenizer))
            results["Q4_K_M file made by"] = "inference_engine_gguf.export (simple quantizer)"
        text = tokenizer.encode(" ".join(SAMPLE_TEXT))[:64]
        # The Q4_K_M file's own values, as float32: transformers on them is the exact reference
        # for our Q4_K_M run, and llama.cpp on an F32 file of them separates its quantized
        # dot products (activations rounded to Q8_K) from the weights' quantization.
        hf_q4 = with_file_weights(hf, q4)
        with torch.no_grad():
            hf_q4_logprobs = log_softmax(hf_q4(torch.tensor([text])).logits[0].numpy())
            hf_raw = hf(torch.tensor([text])).logits[0].double().numpy()
            hf_logprobs = log_softmax(hf_raw)
        q4_as_f32 = os.path.join(work, "model-q4_k_m-as-f32.gguf")
        export_to_gguf(hf_q4, tokenizer, q4_as_f32, T.F32,
                       extra_control_tokens=VOCAB - len(tokenizer))
        del hf_q4
        rng = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, len(tokenizer), (16,), generator=rng).tolist()
                   for _ in range(args.concurrency)]
        bf16_bytes = sum(p.numel() for p in hf.parameters()) * 2
        del hf
        for label, path in (("F32", f32), ("Q4_K_M", q4)):
            llm = LLM(path, dtype=args.dtype, show_progress=False, enable_prefix_caching=False)
            ours = our_logprobs(llm, text)
            ours_raw = our_raw_logits(llm, text) if label == "F32" else None
            if label == "F32":
                # The reference mode: float tensors multiplied in float64, rounded once.
                exact = LLM(path, dtype=args.dtype, show_progress=False,
                            enable_prefix_caching=False, quant_options={"accumulate": "float64"})
                ours_raw64 = our_raw_logits(exact, text)
                del exact
            if label == "F32":
                results["F32 max |logprob ours - transformers|"] = float(
                    np.abs(ours - hf_logprobs).max())
                results["F32 max |logit ours - transformers|"] = float(
                    np.abs(ours_raw - hf_raw).max())
            if label == "Q4_K_M":
                # activations=float: the exact product with the file's values.
                exact = LLM(path, dtype=args.dtype, show_progress=False,
                            enable_prefix_caching=False, quant_options={"activations": "float"})
                ours_float = our_logprobs(exact, text)
                results["Q4_K_M (activations=float) max |logprob ours - transformers on its "
                        "values|"] = float(np.abs(ours_float - hf_q4_logprobs).max())
                if not args.logits_only:
                    results[f"ours {args.concurrency}-concurrent tok/s (Q4_K_M, "
                            "activations=float)"] = median(
                        lambda llm=exact: ours_concurrent(llm, prompts, args.new_tokens),
                        args.repeats, f"ours {args.concurrency}-concurrent, activations=float")
                del exact
                results["ours Q4_K_M weight bytes / bf16"] = round(
                    model_weight_bytes(llm.engine.model) / bf16_bytes, 3)
            if label == "Q4_K_M" and not args.logits_only:
                results["ours batch-1 decode tok/s (Q4_K_M)"] = median(
                    lambda llm=llm: ours_decode(llm, prompts[0], args.new_tokens), args.repeats,
                    "ours batch-1 decode")
                results[f"ours {args.concurrency}-concurrent tok/s (Q4_K_M)"] = median(
                    lambda llm=llm: ours_concurrent(llm, prompts, args.new_tokens), args.repeats,
                    f"ours {args.concurrency}-concurrent")
            del llm
            if python is None:
                continue
            npy = os.path.join(work, f"logits-{label}.npy")
            run_llamacpp(python, {"op": "logits", "model": path, "tokens": text, "out_npy": npy},
                         work)
            raw_logits = np.load(npy)
            ref = log_softmax(raw_logits)
            diff = np.abs(ours - ref).max()
            if label == "F32":
                results["F32 max |logit ours - llama.cpp| (raw logits, target 1e-5)"] = float(
                    np.abs(ours_raw - raw_logits).max())
                results["F32 (accumulate=float64) max |logit ours - llama.cpp|"] = float(
                    np.abs(ours_raw64 - raw_logits).max())
                results["F32 max |logprob llama.cpp - transformers|"] = float(
                    np.abs(ref - hf_logprobs).max())
                results["F32 max |logit llama.cpp - transformers|"] = float(
                    np.abs(raw_logits - hf_raw).max())
                results["F32 max |logit| (llama.cpp)"] = float(np.abs(raw_logits).max())
            top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
            results[f"{label} max |logprob ours - llama.cpp|"] = float(diff)
            results[f"{label} top-1 agreement"] = top1
            # Positions before the first one more than 1e-4 apart (an 8-bit rounding flip
            # on Q4_K_M shows up as a jump, then spreads to later positions).
            apart = np.abs(ours - ref).max(axis=-1) > 1e-4
            results[f"{label} leading positions within 1e-4 of llama.cpp"] = (
                f"{int(np.argmax(apart)) if apart.any() else len(apart)}/{len(apart)}")
            print(f"{label}: max abs log-prob diff {diff:.3e}, top-1 agreement {top1:.3f}",
                  flush=True)
            if label == "Q4_K_M":
                npy = os.path.join(work, "logits-q4-as-f32.npy")
                run_llamacpp(python, {"op": "logits", "model": q4_as_f32, "tokens": text,
                                      "out_npy": npy}, work)
                ref = log_softmax(np.load(npy))
                results["Q4_K_M values as F32: max |logprob ours(Q4_K_M, activations=float) - "
                        "llama.cpp|"] = float(np.abs(ours_float - ref).max())
        if python is not None and not args.logits_only:
            ours_total = results[f"ours {args.concurrency}-concurrent tok/s (Q4_K_M)"]
            job = {"op": "decode", "model": q4, "prompt": prompts[0], "new_tokens": args.new_tokens}
            policy = os.environ.get("OMP_WAIT_POLICY", "unset")
            rate = median(lambda: run_llamacpp(python, job, work)["tokens_per_s"],
                          args.repeats, "llama.cpp batch-1 decode")
            results[f"llama.cpp batch-1 decode tok/s (Q4_K_M, OMP_WAIT_POLICY={policy})"] = rate
            results[f"ours {args.concurrency}-concurrent / llama.cpp single stream"] = round(
                ours_total / rate, 2)
            if policy != "unset":
                # llama.cpp's own default: its threads spin between ops (ours stay as run).
                rate = median(lambda: run_llamacpp(python, job, work, spinning=True)[
                    "tokens_per_s"], args.repeats, "llama.cpp batch-1 decode, spinning threads")
                results["llama.cpp batch-1 decode tok/s (Q4_K_M, OMP_WAIT_POLICY unset)"] = rate
                results[f"ours {args.concurrency}-concurrent / llama.cpp single stream "
                        "(llama.cpp spinning)"] = round(ours_total / rate, 2)
    print("\nresults")
    for name, value in results.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {name:48s} {shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
