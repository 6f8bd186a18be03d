"""``inference-engine env``: schema, truthful CPU report, simulated machines, errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from inference_engine.env_report import collect_env, format_env
from inference_engine.platforms.device_info import simulate_devices
from inference_engine.platforms.simulated_devices import machine_from_spec
from inference_engine.testing import has_accelerator, run_cli

TOP_KEYS = {"inference_engine", "python", "os", "versions", "simulated_devices", "platform",
            "platforms", "visible_devices_env", "attention_backend", "attention_backends",
            "quantization_kernels", "plugins"}
PLATFORM_KEYS = {"name", "device_type", "simulated", "device_count", "devices",
                 "selected_device_ids", "capability", "arch", "memory", "supported_dtypes",
                 "fp8_dtype", "fp8_max", "fp8_scale_adjustment", "fp4", "triton",
                 "attention_backends", "fp8_gemm_kernels", "fp4_gemm_kernels", "quant_kernels"}


def _mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


@pytest.mark.skipif(has_accelerator(), reason="asserts that this machine is CPU-only")
def test_env_json_reports_this_cpu_machine_truthfully(monkeypatch):
    monkeypatch.delenv("INFERENCE_ENGINE_SIMULATED_DEVICES", raising=False)
    result = run_cli("env", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert TOP_KEYS <= set(report) and PLATFORM_KEYS <= set(report["platform"])
    p = report["platform"]
    assert p["name"] == "cpu" and p["device_type"] == "cpu" and p["simulated"] is False
    assert p["device_count"] == 1 and p["selected_device_ids"] == [0]
    assert p["memory"]["total_bytes"] == _mem_total_bytes()
    assert p["fp8_dtype"] is None and p["fp4"] is False and p["capability"] is None
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["transformers"] == transformers.__version__
    assert report["versions"]["torch_cuda"] == torch.version.cuda
    present = {q["name"] for q in report["platforms"] if q["present"]}
    assert present == {"cpu"}
    assert report["attention_backend"] == "cpu_paged"  # what "auto" takes here
    assert report["quantization_kernels"]["unquantized"] == "unquantized torch matmul"
    assert any(i["name"] == "builtin" and i["status"] == "ok" for i in report["plugins"])


def test_env_on_a_simulated_machine_with_device_ids(monkeypatch):
    monkeypatch.setenv("INFERENCE_ENGINE_SIMULATED_DEVICES", "h100:2")
    result = run_cli("env", "--json", "--device-ids", "1")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    p = report["platform"]
    assert report["simulated_devices"] is True and p["simulated"] is True
    assert (p["name"], p["arch"], p["capability"]) == ("cuda", "sm90", [9, 0])
    assert p["selected_device_ids"] == [1] and p["device_count"] == 2
    assert p["fp8_dtype"] == "e4m3fn"


def test_env_errors_name_the_problem(monkeypatch):
    monkeypatch.delenv("INFERENCE_ENGINE_SIMULATED_DEVICES", raising=False)
    result = run_cli("env", "--platform", "cuda")
    assert result.returncode == 2
    assert "--platform cuda: the platform is installed but no cuda device" in result.stderr
    result = run_cli("env", "--device-ids", "0,0")
    assert result.returncode == 2 and "more than once" in result.stderr


def test_collect_env_in_process_for_an_sm120_machine():
    with simulate_devices(machine_from_spec("rtx5090")):
        report = collect_env()
    p = report["platform"]
    assert p["cuda_family"] == "sm120" and p["fp4"] is True
    assert "torch._scaled_mm (fp4 block-scaled)" in p["quant_kernels"]
    text = format_env(report)
    assert "NVIDIA GeForce RTX 5090" in text and "[SIMULATED devices]" in text
    assert "capability 12.0" in text
