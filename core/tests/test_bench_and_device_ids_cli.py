"""``bench`` runs its fixed workload; ``--device-ids`` / ``device_ids=`` reach the platform."""

from __future__ import annotations

import json

import pytest
from inference_engine.platforms.device_ids import InvalidDeviceIdsError
from inference_engine.testing import TEST_PLATFORM, cpu_llm, make_tiny_model, run_cli


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path)
    return str(path)


def test_bench_json_counts_the_fixed_workload(tiny_model):
    result = run_cli("bench", "--model", tiny_model, "--num-prompts", "3", "--input-len", "5",
                     "--output-len", "4", "--device-ids", "0", "--json",
                     "--kv-cache-memory", str(4 << 20), "--platform", TEST_PLATFORM)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["platform"] == "cpu" and report["device"].startswith("cpu (")
    assert report["prompt_tokens"] == 3 * 5
    assert report["generated_tokens"] == 3 * 4  # ignore_eos: every request runs to output_len
    assert report["output_tokens_per_s"] > 0
    assert report["kv_cache_dtype"] == "float32"  # a float32 checkpoint, "auto"


def test_bench_kv_cache_dtype_option(tiny_model):
    result = run_cli("bench", "--model", tiny_model, "--num-prompts", "2", "--input-len", "4",
                     "--output-len", "3", "--json", "--kv-cache-dtype", "bfloat16",
                     "--kv-cache-memory", str(4 << 20), "--platform", TEST_PLATFORM)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kv_cache_dtype"] == "bfloat16"
    bad = run_cli("bench", "--model", tiny_model, "--kv-cache-dtype", "fp4",
                  "--platform", TEST_PLATFORM)
    assert bad.returncode == 2 and "--kv-cache-dtype must be one of" in bad.stderr


def test_generate_rejects_a_missing_device_naming_what_exists(tiny_model):
    result = run_cli("generate", "--model", tiny_model, "--prompt", "hi", "--device-ids", "3",
                     "--platform", TEST_PLATFORM)
    assert result.returncode == 2
    assert "no device 3; cpu has 1 device: 0 (" in result.stderr


def test_llm_device_ids(tiny_model):
    llm = cpu_llm(tiny_model, device_ids=[0], kv_cache_memory=4 << 20, show_progress=False)
    assert llm.engine.platform.device_ids == [0]
    with pytest.raises(InvalidDeviceIdsError, match="cpu has 1 device"):
        cpu_llm(tiny_model, device_ids="2", show_progress=False)
    with pytest.raises(ValueError, match="-1"):
        cpu_llm(tiny_model, device_ids=[-1], show_progress=False)
