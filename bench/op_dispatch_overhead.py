"""What registering the CPU kernels as torch.library ops through the stable ABI would cost per call.

The engine binds its C++ CPU kernels with pybind11 (``torch.utils.cpp_extension.load``). The
house-in-order issue asks to follow torch's stable-ABI work (ops registered with
``STABLE_TORCH_LIBRARY`` that touch tensors only through ``torch/csrc/stable``). This builds one
trivial op and one allocating op both ways and times a call from Python (best of 5 runs of
20,000 calls), so the per-call price of the dispatcher is known before the kernels move.

Run: ``cd bench && OMP_WAIT_POLICY=PASSIVE ../.venv/bin/python op_dispatch_overhead.py``
(builds two small extensions on first use, about a minute).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

CSRC = Path(__file__).resolve().parent / "csrc"


def per_call_us(fn: Callable[[], object], calls: int = 20_000, runs: int = 5) -> float:
    """Best-of-``runs`` mean time of one call, in microseconds."""
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    pybind = load("ie_dispatch_probe_pybind", [str(CSRC / "dispatch_probe_pybind.cpp")],
                  extra_cflags=["-O2"])
    version = torch.__version__.split("+")[0].split(".")
    target = f"0x{int(version[0]):02x}{int(version[1]):02x}000000000000"
    load("ie_dispatch_probe_stable", [str(CSRC / "dispatch_probe_stable.cpp")],
         extra_cflags=["-O2", f"-DTORCH_TARGET_VERSION={target}"], is_python_module=False)
    stable = torch.ops.ie_abi_test
    x, w = torch.zeros(8, 4096), torch.ones(4096)
    rows = [
        ("pybind11, in place", per_call_us(lambda: pybind.ident(x, w, 1e-6))),
        ("stable torch.library op, in place", per_call_us(lambda: stable.ident(x, w, 1e-6))),
        ("pybind11, allocates its output", per_call_us(lambda: pybind.alloc(x))),
        ("stable torch.library op, allocates", per_call_us(lambda: stable.alloc(x))),
        ("torch.empty_like (for scale)", per_call_us(lambda: torch.empty_like(x))),
    ]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for name, us in rows:
        print(f"{name:38s} {us:6.2f} us/call")


if __name__ == "__main__":
    main()
