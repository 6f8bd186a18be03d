"""Shipped gfx942/gfx950 tables: exact entries, nearest shapes and defaults via the hook."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from inference_engine.kernel_tuning import clear_tuning_cache, tuning_config
from inference_engine.platforms.device_info import simulate_devices
from inference_engine.platforms.selection import select_platform
from inference_engine.platforms.simulated_devices import machine_from_spec
from inference_engine_rocm.tuning import (
    CONFIG_KEYS,
    TuningTable,
    load_table,
    lookup,
    shipped_tables,
)

KERNEL_DEFAULT = {"BLOCK_SIZE_M": 1, "BLOCK_SIZE_N": 1, "BLOCK_SIZE_K": 1, "GROUP_SIZE_M": 1,
                  "num_warps": 1, "num_stages": 1}


def _raw(arch, op):
    path = resources.files("inference_engine_rocm") / "tuning_tables" / arch / f"{op}.json"
    return json.loads(path.read_text())


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_tuning_cache()
    yield
    clear_tuning_cache()


def test_every_arch_and_op_is_shipped_and_valid():
    assert set(shipped_tables()) == {(a, o) for a in ("gfx942", "gfx950")
                                     for o in ("fused_moe", "fp8_gemm", "fp8_block_gemm")}
    lds = {"gfx942": 64 << 10, "gfx950": 160 << 10}
    for arch, op in shipped_tables():
        table = load_table(arch, op)
        assert table.arch == arch and table.op == op and table.entries
        assert "not measured" in table.provenance
        elem = 2 if op == "fused_moe" else 1
        for shape, config in table.entries:
            assert set(CONFIG_KEYS) <= set(config)
            tile = (config["BLOCK_SIZE_M"] + config["BLOCK_SIZE_N"]) * config["BLOCK_SIZE_K"]
            assert tile * elem * config["num_stages"] <= lds[arch], (arch, op, shape)
            if op == "fp8_block_gemm":
                assert config["BLOCK_SIZE_K"] == 128  # the scale block


@pytest.mark.parametrize("profile,arch", [("mi300x", "gfx942"), ("mi355x", "gfx950")])
@pytest.mark.parametrize("op", ["fused_moe", "fp8_gemm", "fp8_block_gemm"])
def test_known_shapes_return_the_shipped_entry_through_the_hook(profile, arch, op):
    raw = _raw(arch, op)
    with simulate_devices(machine_from_spec(profile)):
        platform = select_platform()
        for entry in raw["entries"][:: max(1, len(raw["entries"]) // 12)]:
            got = tuning_config(op, entry["shape"], KERNEL_DEFAULT, platform)
            assert got == entry["config"], entry["shape"]


def test_nearest_m_within_the_same_weight_shape():
    raw = _raw("gfx942", "fp8_gemm")
    by_m = {e["shape"]["M"]: e["config"] for e in raw["entries"]
            if (e["shape"]["N"], e["shape"]["K"]) == (4096, 4096)}
    table = load_table("gfx942", "fp8_gemm")
    assert lookup(table, {"M": 100, "N": 4096, "K": 4096}) == by_m[128]  # |100-128| < |100-64|
    assert lookup(table, {"M": 90, "N": 4096, "K": 4096}) == by_m[64]
    assert lookup(table, {"M": 96, "N": 4096, "K": 4096}) == by_m[64]  # tie: the smaller M
    assert lookup(table, {"M": 100000, "N": 4096, "K": 4096}) == by_m[max(by_m)]


def test_nearest_weight_shape_then_default():
    table = TuningTable.from_json({
        "op": "fp8_gemm", "arch": "gfx942", "match_keys": ["N", "K"], "nearest_key": "M",
        "default": dict(KERNEL_DEFAULT, num_warps=2),
        "entries": [
            {"shape": {"N": 4096, "K": 4096, "M": 16}, "config": dict(KERNEL_DEFAULT, num_warps=4)},
            {"shape": {"N": 8192, "K": 4096, "M": 16}, "config": dict(KERNEL_DEFAULT, num_warps=8)},
            {"shape": {"N": 8192, "K": 4096, "M": 512},
             "config": dict(KERNEL_DEFAULT, num_warps=16)},
        ],
    })
    assert lookup(table, {"N": 4500, "K": 4096, "M": 16})["num_warps"] == 4  # log-nearest N
    assert lookup(table, {"N": 7000, "K": 4096, "M": 16})["num_warps"] == 8
    assert lookup(table, {"N": 7000, "K": 4096, "M": 400})["num_warps"] == 16
    assert lookup(table, {"N": 4096, "K": 16384, "M": 16})["num_warps"] == 2  # K 4x off: default
    assert lookup(table, {"N": 4096, "M": 16})["num_warps"] == 2  # no K: default


def test_far_shape_falls_back_to_the_table_default_via_the_hook():
    raw = _raw("gfx950", "fused_moe")
    with simulate_devices(machine_from_spec("mi355x")):
        got = tuning_config("fused_moe", {"E": 4, "N": 64, "K": 64, "topk": 1, "M": 8},
                            KERNEL_DEFAULT, select_platform())
    assert got == raw["default"]


def test_other_platforms_and_ops_get_the_kernel_default():
    for spec in ("h100", "mi250x"):
        with simulate_devices(machine_from_spec(spec)):
            got = tuning_config("fp8_gemm", {"M": 16, "N": 4096, "K": 4096}, KERNEL_DEFAULT,
                                select_platform())
        assert got == KERNEL_DEFAULT, spec
    with simulate_devices(machine_from_spec("mi300x")):
        assert tuning_config("some_new_op", {"M": 1}, KERNEL_DEFAULT,
                             select_platform()) == KERNEL_DEFAULT


def test_bad_table_errors_name_the_file():
    with pytest.raises(ValueError, match="tuning table x.json: .*entry 0 lacks config keys"):
        TuningTable.from_json({"op": "o", "arch": "a", "match_keys": ["N"], "nearest_key": "M",
                               "default": KERNEL_DEFAULT,
                               "entries": [{"shape": {"N": 1, "M": 1}, "config": {}}]},
                              source="x.json")


def test_generator_reproduces_the_shipped_tables():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tuning_tables.py"
    spec = importlib.util.spec_from_file_location("make_tuning_tables", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for arch in ("gfx942", "gfx950"):
        for op, table in module.build(arch).items():
            assert json.loads(module._dumps(table)) == _raw(arch, op), (arch, op)


def _brute_force_nearest_m(table, shape):
    """Reference: same weight shape, smallest |M - m|, then smallest m (spelled out directly)."""
    best = None
    for s, c in table.entries:
        if all(s[k] == shape[k] for k in table.match_keys):
            key = (abs(s["M"] - shape["M"]), s["M"])
            if best is None or key < best[0]:
                best = (key, c)
    return best[1]


def test_lookup_matches_a_brute_force_reference_for_shipped_weight_shapes():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tables = [load_table(a, o) for a, o in shipped_tables()]

    @settings(max_examples=150, deadline=None)
    @given(st.sampled_from(tables), st.data(), st.integers(min_value=1, max_value=20000))
    def check(table, data, m):
        shape, _ = data.draw(st.sampled_from(table.entries))
        query = {**{k: shape[k] for k in table.match_keys}, "M": m}
        assert lookup(table, query) == _brute_force_nearest_m(table, query)

    check()
