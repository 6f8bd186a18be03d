"""llama.cpp side of bench/gguf_vs_llamacpp.py, run by the interpreter that has llama-cpp-python.

Kept apart so llama-cpp-python can live in its own virtualenv (it compiles
llama.cpp from source). Reads a JSON job on argv[1], writes results to argv[2]:

* ``{"op": "quantize", "src": f32.gguf, "dst": out.gguf, "ftype": "Q4_K_M"}``
* ``{"op": "logits", "model": file, "tokens": [...]}`` -> ``{"logits_npy": path}``
  (float32 ``[n, vocab]``, f32 KV cache, flash attention off, every position;
  ``"verbose": true`` lets llama.cpp log to stderr, e.g. why it refused a file)
* ``{"op": "decode", "model": file, "prompt": [...], "new_tokens": n}`` ->
  ``{"tokens_per_s": ..., "tokens": [...], "cpu_ms_per_token": ...}`` greedy, one stream,
  EOS ignored (the CPU time is the process's, all its threads)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import numpy as np


def _llama(model: str, n_ctx: int, logits_all: bool, verbose: bool = False):
    from llama_cpp import Llama

    threads = int(os.environ.get("LLAMACPP_THREADS", os.cpu_count() or 1))
    return Llama(model_path=model, n_ctx=n_ctx, n_batch=min(n_ctx, 512), logits_all=logits_all,
                 type_k=0, type_v=0, flash_attn=False, n_threads=threads,
                 n_threads_batch=threads, verbose=verbose, seed=0)


def quantize(job: dict) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{job['ftype']}")
    rc = llama_cpp.llama_model_quantize(job["src"].encode(), job["dst"].encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"path": job["dst"]}


def logits(job: dict) -> dict:
    tokens = job["tokens"]
    llm = _llama(job["model"], n_ctx=max(64, len(tokens) + 8), logits_all=True,
                 verbose=bool(job.get("verbose")))
    llm.eval(tokens)
    scores = np.asarray(llm.scores[: len(tokens)], dtype=np.float32)
    path = job["out_npy"]
    np.save(path, scores)
    return {"logits_npy": path}


def decode(job: dict) -> dict:
    prompt, n = job["prompt"], int(job["new_tokens"])
    llm = _llama(job["model"], n_ctx=len(prompt) + n + 8, logits_all=False)
    llm.eval(prompt)
    out = []
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": n / elapsed, "tokens": out,
            "cpu_ms_per_token": (time.process_time() - cpu) / n * 1e3}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = {"quantize": quantize, "logits": logits, "decode": decode}[job["op"]](job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
