"""Shipped Triton launch tables for gfx942/gfx950, looked up by nearest problem shape.

One JSON file per (arch, op) under ``tuning_tables/<arch>/<op>.json``::

    {"op": "fp8_gemm", "arch": "gfx942", "provenance": "...",
     "match_keys": ["N", "K"], "nearest_key": "M",
     "default": {...launch config...},
     "entries": [{"shape": {"N": 4096, "K": 4096, "M": 16}, "config": {...}}, ...]}

Lookup (:func:`lookup`):

1. Entries whose ``match_keys`` equal the query's exactly; among them the one
   whose ``nearest_key`` (M, the token count) is closest (ties: the smaller M).
2. Otherwise the entries with the nearest weight shape, measured as the sum of
   ``|log2(a/b)|`` over ``match_keys``, provided every such key is within a
   factor of 2 of the query; then the closest M among them.
3. Otherwise (or when the query lacks a match key) the table's ``default``.

The shipped values are heuristic starting points (see
``plugins/rocm/scripts/make_tuning_tables.py``), not measurements.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["TuningTable", "load_table", "lookup", "shipped_tables", "tuned_config"]

CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
               "num_stages")
# A weight dimension further than this factor from every entry's means "no near shape".
MAX_RATIO = 2.0


@dataclass(frozen=True)
class TuningTable:
    op: str
    arch: str
    match_keys: tuple[str, ...]
    nearest_key: str
    default: dict[str, Any]
    # (shape, config) pairs.
    entries: tuple[tuple[dict[str, int], dict[str, Any]], ...]
    provenance: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "<table>") -> TuningTable:
        """Parse and check a table; errors name the file and the bad entry."""
        try:
            match_keys = tuple(data["match_keys"])
            nearest = data["nearest_key"]
            default = dict(data["default"])
            entries = []
            for i, entry in enumerate(data["entries"]):
                shape = {str(k): int(v) for k, v in entry["shape"].items()}
                missing = [k for k in (*match_keys, nearest) if k not in shape]
                if missing:
                    raise ValueError(f"entry {i} lacks shape keys {missing}")
                config = dict(entry["config"])
                _check_config(config, f"entry {i}")
                entries.append((shape, config))
            _check_config(default, "default")
            return cls(str(data["op"]), str(data["arch"]), match_keys, str(nearest), default,
                       tuple(entries), str(data.get("provenance", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"tuning table {source}: {type(exc).__name__}: {exc}") from exc


def _check_config(config: dict[str, Any], where: str) -> None:
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{where} lacks config keys {missing}")
    bad = [k for k in CONFIG_KEYS if not isinstance(config[k], int) or config[k] <= 0]
    if bad:
        raise ValueError(f"{where}: {bad} must be positive integers")


def _log_distance(a: dict[str, int], b: dict[str, int], keys: tuple[str, ...]) -> float:
    return sum(abs(math.log2(max(a[k], 1) / max(b[k], 1))) for k in keys)


def lookup(table: TuningTable, shape: dict[str, int]) -> dict[str, Any]:
    """The config for ``shape`` by the rules in the module docstring (a fresh dict)."""
    keys = table.match_keys
    if any(k not in shape for k in keys) or not table.entries:
        return dict(table.default)
    exact = [(s, c) for s, c in table.entries if all(s[k] == shape[k] for k in keys)]
    candidates = exact
    if not candidates:
        limit = math.log2(MAX_RATIO)
        near = [
            (s, c) for s, c in table.entries
            if all(abs(math.log2(max(s[k], 1) / max(shape[k], 1))) <= limit for k in keys)
        ]
        if not near:
            return dict(table.default)
        best = min(_log_distance(s, shape, keys) for s, _ in near)
        candidates = [(s, c) for s, c in near if _log_distance(s, shape, keys) == best]
    m = shape.get(table.nearest_key)
    if m is None:
        return dict(table.default)
    _shape, config = min(candidates, key=lambda sc: (abs(sc[0][table.nearest_key] - m),
                                                     sc[0][table.nearest_key]))
    return dict(config)


@cache
def shipped_tables() -> tuple[tuple[str, str], ...]:
    """(arch, op) of every table this distribution ships."""
    root = resources.files("inference_engine_rocm") / "tuning_tables"
    found = []
    for arch_dir in root.iterdir():
        if arch_dir.is_dir():
            for f in arch_dir.iterdir():
                if f.name.endswith(".json"):
                    found.append((arch_dir.name, f.name.removesuffix(".json")))
    return tuple(sorted(found))


@cache
def load_table(arch: str, op: str) -> TuningTable | None:
    """The shipped table for (arch, op), or None."""
    if (arch, op) not in shipped_tables():
        return None
    path = resources.files("inference_engine_rocm") / "tuning_tables" / arch / f"{op}.json"
    return TuningTable.from_json(json.loads(path.read_text()), source=f"{arch}/{op}.json")


def tuned_config(op_name: str, arch: str, shape: dict[str, int]) -> dict[str, Any] | None:
    """The shipped answer for (op, arch, shape); None when no table covers the pair."""
    table = load_table(arch, op_name)
    return None if table is None else lookup(table, shape)
