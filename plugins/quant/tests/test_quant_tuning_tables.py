"""Bucketed lookup of the quantized kernels' tuning tables, and the hook answering nothing
where no table is shipped."""

from __future__ import annotations

import pytest
from inference_engine_quant.tuning_tables import bucket_m, lookup, tuned_config

TABLE = {
    "op": "fp8_block_gemm", "arch": "sm90", "measured": True, "match_keys": ["N", "K"],
    "entries": [
        {"shape": {"N": 4096, "K": 4096, "M": 16}, "config": {"SPLIT_K": 4}},
        {"shape": {"N": 4096, "K": 4096, "M": 512}, "config": {"SPLIT_K": 1}},
        {"shape": {"N": 1024, "K": 4096, "M": 16}, "config": {"SPLIT_K": 8}},
    ],
}


@pytest.mark.parametrize(("m", "bucket"), [(1, 1), (3, 4), (17, 32), (129, 256), (512, 512)])
def test_bucket_m(m, bucket):
    assert bucket_m(m) == bucket


def test_lookup_takes_the_smallest_bucket_holding_m():
    assert lookup(TABLE, {"M": 1, "N": 4096, "K": 4096}) == {"SPLIT_K": 4}
    assert lookup(TABLE, {"M": 17, "N": 4096, "K": 4096}) == {"SPLIT_K": 1}
    assert lookup(TABLE, {"M": 9999, "N": 4096, "K": 4096}) == {"SPLIT_K": 1}  # largest bucket


def test_lookup_nearest_weight_shape_within_a_factor_of_two():
    assert lookup(TABLE, {"M": 1, "N": 1200, "K": 4096}) == {"SPLIT_K": 8}
    assert lookup(TABLE, {"M": 1, "N": 256, "K": 4096}) is None  # 4x away from every entry
    assert lookup(TABLE, {"M": 1, "N": 4096}) is None  # a match key missing


def test_no_shipped_table_means_no_answer():
    assert tuned_config("fp8_block_gemm", "sm90", {"M": 1, "N": 4096, "K": 4096}) is None
