"""--hf-overrides / hf_overrides and --indexer-dtype: config.json values replaced before the build."""

from __future__ import annotations

import subprocess
import sys

import pytest
from inference_engine.cli_values import model_config_overrides
from inference_engine.testing import cpu_llm, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("overrides"), "qwen3")


def test_overrides_reach_the_model(tiny):
    llm = cpu_llm(tiny, hf_overrides={"rms_norm_eps": 0.25, "indexer_dtype": "fp8"})
    model = llm.engine.model
    assert model.ctx.hf_config.rms_norm_eps == 0.25
    assert model.ctx.hf_config.indexer_dtype == "fp8"
    assert {layer.input_layernorm.eps for layer in model.model.layers} == {0.25}


def test_flag_values_are_parsed_and_checked():
    assert model_config_overrides('{"a": 1}', "fp8") == {"a": 1, "indexer_dtype": "fp8"}
    assert model_config_overrides(None, None) == {}
    with pytest.raises(ValueError, match="--hf-overrides is not valid JSON"):
        model_config_overrides("{nope", None)
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        model_config_overrides("[1, 2]", None)
    with pytest.raises(ValueError, match="--indexer-dtype must be one of auto, fp8, model"):
        model_config_overrides(None, "int4")


def test_generate_cli_takes_and_refuses_the_flags(tiny):
    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "inference_engine.cli", "generate", "--model", str(tiny),
             "--prompt", "hi", "--max-tokens", "2", "--platform", "cpu", "--json", *flags],
            capture_output=True, text=True, timeout=300)

    ok = run("--hf-overrides", '{"rms_norm_eps": 0.25}', "--indexer-dtype", "model")
    assert ok.returncode == 0, ok.stderr
    bad = run("--hf-overrides", "[1]")
    assert bad.returncode == 2 and "--hf-overrides must be a JSON object" in bad.stderr
