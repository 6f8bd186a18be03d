"""`make demo`: show the installed engine and its plugins (later issues serve a model)."""

from __future__ import annotations

import subprocess
import sys


def main() -> int:
    print("==> inference-engine --version")
    subprocess.run([sys.executable, "-m", "inference_engine.cli", "--version"], check=True)
    print("\n==> inference-engine list-plugins")
    subprocess.run([sys.executable, "-m", "inference_engine.cli", "list-plugins", "--strict"],
                   check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
