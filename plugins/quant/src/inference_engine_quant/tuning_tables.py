"""Launch tables of the quantized kernels per GPU arch, for ``ie_kernel_tuning_config``.

One JSON file per (arch, op) under ``tuning_tables/<arch>/<op>.json`` (``arch`` as
the platform's ``arch_name()``, e.g. ``sm90``), written by
``bench/tune_gpu_kernels.py`` from a sweep on that GPU::

    {"op": "fp8_block_gemm", "arch": "sm90", "measured": true,
     "provenance": "bench/tune_gpu_kernels.py on NVIDIA H200, 2026-..",
     "match_keys": ["N", "K"],
     "entries": [{"shape": {"N": 4096, "K": 4096, "M": 16}, "config": {...}}, ...]}

``M`` (tokens) is bucketed to powers of two: an entry's ``M`` is a bucket's upper
end, and a query takes the smallest bucket holding its M (the largest when M is
beyond them all), so there are no per-M lookups. The weight shape must match
exactly on ``match_keys`` (N, K, and E/topk for fused MoE); the nearest entry
by ``log2`` distance within a factor of 2 serves otherwise; else no answer (the
kernel's default). Only measured tables are shipped (none yet: no GPU was
measured when this was written).
"""

from __future__ import annotations

import json
import math
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["bucket_m", "load_table", "lookup", "tuned_config"]

_MAX_RATIO_LOG2 = 1.0


def bucket_m(m: int) -> int:
    """The power-of-two bucket (upper end) that holds ``m`` tokens."""
    return 1 << max(0, (max(int(m), 1) - 1).bit_length())


def _root() -> Path:
    return Path(str(resources.files("inference_engine_quant"))) / "tuning_tables"


@cache
def load_table(arch: str, op: str) -> dict[str, Any] | None:
    """The shipped table of (arch, op), checked; None when there is none.

    Raises:
        ValueError: a malformed table, naming the file and the problem.
    """
    path = _root() / arch / f"{op}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    try:
        keys = list(data["match_keys"])
        for i, entry in enumerate(data["entries"]):
            missing = [k for k in (*keys, "M") if k not in entry["shape"]]
            if missing:
                raise ValueError(f"entry {i} lacks shape keys {missing}")
            if not isinstance(entry["config"], dict):
                raise ValueError(f"entry {i}: config must be an object")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"tuning table {path}: {type(exc).__name__}: {exc}") from exc
    return data


def lookup(table: dict[str, Any], shape: dict[str, int]) -> dict[str, Any] | None:
    """The config for ``shape`` by the module's rules (a fresh dict), or None."""
    keys = table["match_keys"]
    if any(k not in shape for k in keys) or not table["entries"]:
        return None

    def distance(entry_shape: dict[str, int]) -> float:
        return sum(abs(math.log2(max(entry_shape[k], 1) / max(shape[k], 1))) for k in keys)

    near = [e for e in table["entries"]
            if all(abs(math.log2(max(e["shape"][k], 1) / max(shape[k], 1))) <= _MAX_RATIO_LOG2
                   for k in keys)]
    if not near:
        return None
    best = min(distance(e["shape"]) for e in near)
    candidates = [e for e in near if distance(e["shape"]) == best]
    m = bucket_m(shape.get("M", 1))
    holding = [e for e in candidates if e["shape"]["M"] >= m]
    entry = (min(holding, key=lambda e: e["shape"]["M"]) if holding
             else max(candidates, key=lambda e: e["shape"]["M"]))
    return dict(entry["config"])


def tuned_config(op_name: str, arch: str, shape: dict[str, int]) -> dict[str, Any] | None:
    """The shipped answer for (op, arch, shape); None where no table covers it."""
    table = load_table(arch, op_name)
    return None if table is None else lookup(table, shape)
