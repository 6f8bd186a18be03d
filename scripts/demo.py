"""`make demo`: the installed engine, its plugins, and a batched generate end to end.

No download: a tiny random Qwen3 model and a tokenizer trained here are saved to a
temp dir (the embedded trained demo model is a later issue), then served by
`inference-engine generate`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile


def run(*args: str) -> None:
    print(f"\n==> inference-engine {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "inference_engine.cli", *args], check=True)


def main() -> int:
    run("--version")
    run("list-plugins", "--strict")
    from inference_engine.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as path:
        print(f"\n==> building a tiny random Qwen3 checkpoint in {path}", flush=True)
        make_tiny_model(path, "qwen3")
        run("generate", "--model", path, "--prompt", "The quick brown fox", "--prompt",
            "héllo wörld", "--max-tokens", "16", "--ignore-eos", "--json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
