"""Write the shipped gfx942/gfx950 Triton tuning tables (heuristic starting points).

No AMD GPU was available when these tables were made, so nothing here is
measured. Each configuration is chosen by rules that keep a kernel's
double-buffered tiles inside the architecture's LDS (64 KiB per workgroup on
gfx942, 160 KiB on gfx950) and follow the usual shape of AMD Triton
configurations: small BLOCK_SIZE_M with a deep BLOCK_SIZE_K for decode-sized
M, wider tiles and 8 warps for large M, num_stages 2 (the AMD pipeliner's
sweet spot). Re-tune on hardware and overwrite the JSON files; the lookup code
does not care where the numbers came from.

Run: python plugins/rocm/scripts/make_tuning_tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "inference_engine_rocm" / "tuning_tables"

PROVENANCE = ("heuristic starting points from plugins/rocm/scripts/make_tuning_tables.py "
              "(LDS budget rules); not measured on hardware")

LDS = {"gfx942": 64 << 10, "gfx950": 160 << 10}
STAGES = 2
M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]

# (E, intermediate, hidden, topk) of common MoE models; both expert GEMMs are tabled:
# N = 2*intermediate (gate+up), K = hidden; then N = hidden, K = intermediate (down).
MOE_MODELS = {
    "Mixtral-8x7B": (8, 14336, 4096, 2),
    "Mixtral-8x22B": (8, 16384, 6144, 2),
    "Qwen3-30B-A3B": (128, 768, 2048, 8),
    "Qwen3-235B-A22B": (128, 1536, 4096, 8),
    "DeepSeek-V3": (256, 2048, 7168, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
}

# (N, K) of dense linear layers (Llama-3 8B/70B, Qwen3-32B).
GEMM_SHAPES = [
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672),
    (10240, 5120), (51200, 5120), (5120, 25600),
]

# (N, K) of DeepSeek-V3's block-quantized (128x128) linear layers.
BLOCK_GEMM_SHAPES = [
    (1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384),
    (36864, 7168), (7168, 18432), (4096, 7168), (7168, 2048),
]


def _pow2_at_most(x: int, cap: int, floor: int = 16) -> int:
    v = floor
    while v * 2 <= min(x, cap):
        v *= 2
    return v


def _fit(arch: str, bm: int, bn: int, bk: int, elem_bytes: int) -> tuple[int, int, int]:
    """Shrink BLOCK_SIZE_K, then BLOCK_SIZE_N, until STAGES tiles fit the LDS."""
    while (bm + bn) * bk * elem_bytes * STAGES > LDS[arch]:
        if bk > 32:
            bk //= 2
        elif bn > 16:
            bn //= 2
        else:
            bm //= 2
    return bm, bn, bk


def _config(bm, bn, bk, group, warps):
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
            "GROUP_SIZE_M": group, "num_warps": warps, "num_stages": STAGES}


def moe_config(arch: str, M: int, N: int, K: int, E: int, topk: int) -> dict:
    tokens_per_expert = max(1, M * topk // E)
    wide = arch == "gfx950"
    if tokens_per_expert <= 16:
        bm, bn, bk, group, warps = 16, 64 if wide else 32, 256, 1, 2
    elif tokens_per_expert <= 64:
        bm, bn, bk, group, warps = 32, 128 if wide else 64, 128, 1, 4
    elif tokens_per_expert <= 256:
        bm, bn, bk, group, warps = 64, 128, 128 if wide else 64, 4, 4
    else:
        bm, bn, bk, group, warps = 128, 256 if wide else 128, 64, 8, 8
    bn = _pow2_at_most(N, bn)
    bk = _pow2_at_most(K, bk)
    bm, bn, bk = _fit(arch, bm, bn, bk, elem_bytes=2)  # bf16 activations and weights
    return _config(bm, bn, bk, group, warps)


def fp8_gemm_config(arch: str, M: int, N: int, K: int) -> dict:
    wide = arch == "gfx950"
    if M <= 16:
        bm, bn, bk, group, warps = 16, 128 if wide else 64, 256, 1, 4
    elif M <= 64:
        bm, bn, bk, group, warps = 32, 128 if wide else 64, 256, 1, 4
    elif M <= 256:
        bm, bn, bk, group, warps = 64, 128, 256 if wide else 128, 4, 4
    elif M <= 2048:
        bm, bn, bk, group, warps = 128, 256 if wide else 128, 128, 8, 8
    else:
        bm, bn, bk, group, warps = 256, 256 if wide else 128, 128 if wide else 64, 8, 8
    bn = _pow2_at_most(N, bn)
    bk = _pow2_at_most(K, bk)
    bm, bn, bk = _fit(arch, bm, bn, bk, elem_bytes=1)
    return _config(bm, bn, bk, group, warps)


def fp8_block_gemm_config(arch: str, M: int, N: int, K: int) -> dict:
    # BLOCK_SIZE_K stays the 128-wide scale block; N tiles are multiples of it where N allows.
    wide = arch == "gfx950"
    if M <= 16:
        bm, bn, group, warps = 16, 128 if wide else 64, 1, 4
    elif M <= 64:
        bm, bn, group, warps = 32, 128 if wide else 64, 1, 4
    elif M <= 256:
        bm, bn, group, warps = 64, 128, 4, 4
    elif M <= 2048:
        bm, bn, group, warps = 128, 128, 8, 8
    else:
        bm, bn, group, warps = 256 if wide else 128, 128, 8, 8
    bn = _pow2_at_most(N, bn)
    return _config(bm, bn, 128, group, warps)


def _table(op: str, arch: str, keys: list[str], entries: list[dict], default: dict) -> dict:
    return {"op": op, "arch": arch, "provenance": PROVENANCE, "match_keys": keys,
            "nearest_key": "M", "default": default, "entries": entries}


def build(arch: str) -> dict[str, dict]:
    moe_entries = []
    for E, inter, hidden, topk in MOE_MODELS.values():
        for N, K in ((2 * inter, hidden), (hidden, inter)):
            for M in M_VALUES:
                moe_entries.append({"shape": {"E": E, "N": N, "K": K, "topk": topk, "M": M},
                                    "config": moe_config(arch, M, N, K, E, topk)})
    gemm_entries = [{"shape": {"N": N, "K": K, "M": M}, "config": fp8_gemm_config(arch, M, N, K)}
                    for N, K in GEMM_SHAPES for M in M_VALUES]
    block_entries = [{"shape": {"N": N, "K": K, "M": M},
                      "config": fp8_block_gemm_config(arch, M, N, K)}
                     for N, K in BLOCK_GEMM_SHAPES for M in M_VALUES]
    return {
        "fused_moe": _table("fused_moe", arch, ["E", "N", "K", "topk"], moe_entries,
                            moe_config(arch, 512, 4096, 4096, 8, 2)),
        "fp8_gemm": _table("fp8_gemm", arch, ["N", "K"], gemm_entries,
                           fp8_gemm_config(arch, 64, 4096, 4096)),
        "fp8_block_gemm": _table("fp8_block_gemm", arch, ["N", "K"], block_entries,
                                 fp8_block_gemm_config(arch, 64, 4096, 4096)),
    }


def _dumps(table: dict) -> str:
    """The header keys indented, then one entry per line (reviewable diffs)."""
    head = {k: v for k, v in table.items() if k != "entries"}
    lines = [json.dumps(head, indent=1)[:-2] + ',\n "entries": [']
    rows = [" " + json.dumps(e, separators=(", ", ": ")) for e in table["entries"]]
    lines.append(",\n".join(rows))
    lines.append(" ]\n}\n")
    return "\n".join(lines)


def main() -> None:
    for arch in LDS:
        (OUT / arch).mkdir(parents=True, exist_ok=True)
        for op, table in build(arch).items():
            path = OUT / arch / f"{op}.json"
            path.write_text(_dumps(table))
            print(f"wrote {path} ({len(table['entries'])} entries)")


if __name__ == "__main__":
    main()
