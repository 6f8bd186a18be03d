"""A wider schemathesis run against the server than the test suite's: every operation of its
``/openapi.json``, valid and invalid inputs, ``--examples`` of each per operation.

Fails (exit 1) on any 5xx or any 4xx that is not an OpenAI error object, printing
the case; otherwise prints how many answers each (operation, status) got.

Run:  .venv/bin/python bench/fuzz_server.py --examples 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import schemathesis
from inference_engine.testing import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_server_fuzz import AUTH, KEY, fuzz_operations  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "demo-qwen3-tiny"))
    parser.add_argument("--examples", type=int, default=300,
                        help="valid and invalid cases per operation (each)")
    parser.add_argument("--max-model-len", default="128")
    parser.add_argument("--platform", default=os.environ.get("INFERENCE_ENGINE_TEST_PLATFORM"))
    args = parser.parse_args()

    server = ServerProcess(args.model, "--api-key", KEY, "--enable-auth", "--max-model-len",
                           args.max_model_len, "--max-num-seqs", "32",
                           platform=args.platform)
    began = time.monotonic()
    try:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH,
                                               timeout=30)
        seen = fuzz_operations(schema, server.url, args.examples)
    except AssertionError as exc:
        print("FAIL:", str(exc)[:3000])
        return 1
    finally:
        code = server.stop()
    print(f"fuzz: {sum(seen.values())} cases in {time.monotonic() - began:.0f} s, "
          f"{args.examples} valid + {args.examples} invalid per operation at most; "
          f"server exit {code}")
    for (operation, status), n in sorted(seen.items()):
        print(f"  {operation:28s} {status}  {n}")
    print("fuzz: no 5xx, every 4xx an OpenAI error object")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
