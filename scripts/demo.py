"""`make demo`: serve the embedded demo model and talk to it with the openai client.

1. checks the installed plugins load;
2. starts ``inference-engine serve`` on a free loopback port with the committed
   tiny Qwen3 model (``models/demo-qwen3-tiny``, trained by
   ``scripts/train_demo_model.py``), the ``qwen3`` tool and reasoning parsers
   and an API key, and waits for ``/health``;
3. runs ``scripts/demo_client.py`` against it: a streamed plain answer, a
   streamed tool call (reasoning, parsed call, schema check, tool result sent
   back, final answer), then ``/tokenize`` and ``/metrics``;
4. stops the server. Exits 0 only if every step passed.

No download: the model, its tokenizer and chat template are in the repository.
"""

from __future__ import annotations

import argparse
import secrets
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO_ROOT / "models" / "demo-qwen3-tiny"
SERVED_NAME = "demo-qwen3-tiny"


def banner(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR,
                        help="model folder to serve (default: the committed demo model)")
    model_dir = parser.parse_args(argv).model.resolve()
    from inference_engine import __version__
    from inference_engine.testing import ServerProcess

    banner(f"inference-engine {__version__}: checking that every installed plugin loads")
    subprocess.run([sys.executable, "-m", "inference_engine.cli", "list-plugins", "--strict"],
                   check=True)
    if not (model_dir / "config.json").is_file():
        print(f"DEMO FAILED: the demo model is missing at {model_dir} "
              f"(re-create it with scripts/train_demo_model.py)", file=sys.stderr)
        return 1
    api_key = "demo-" + secrets.token_hex(8)
    flags = ["--served-model-name", SERVED_NAME, "--api-key", api_key,
             "--tool-call-parser", "qwen3", "--reasoning-parser", "qwen3",
             "--enable-auto-tool-choice", "--dtype", "float32", "--log-level", "warning"]
    shown = model_dir.relative_to(REPO_ROOT) if model_dir.is_relative_to(REPO_ROOT) else model_dir
    banner(f"starting the server: inference-engine serve {shown} "
           f"--port <free port> {' '.join(flags)} --kv-cache-memory 64MiB")
    start = time.perf_counter()
    try:
        server = ServerProcess(model_dir, *flags, kv_cache_memory="64MiB", threads=2,
                               startup_timeout=180.0)
    except RuntimeError as exc:
        print(f"DEMO FAILED: the server did not start: {exc}", file=sys.stderr)
        return 1
    print(f"    {server.url}/health is 200 after {time.perf_counter() - start:.1f}s "
          f"(pid {server.proc.pid})", flush=True)
    try:
        banner("running scripts/demo_client.py (official openai package)")
        client = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "demo_client.py"),
                                 "--base-url", server.url, "--api-key", api_key,
                                 "--model", SERVED_NAME])
    finally:
        banner("stopping the server (SIGTERM)")
        code = server.stop()
        print(f"    server exited with {code}", flush=True)
    if client.returncode != 0:
        print(f"\nDEMO FAILED (client exit {client.returncode}); server log:\n"
              f"{server.log() or '(empty)'}", file=sys.stderr)
        return 1
    if code != 0:
        print(f"\nDEMO FAILED: the server exited with {code}; log:\n{server.log()}",
              file=sys.stderr)
        return 1
    banner("demo passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
