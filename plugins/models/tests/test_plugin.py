"""The distribution is discovered through its entry point and registers its architectures."""

import pytest
from inference_engine.interfaces.model import CausalLM
from inference_engine.plugins import load_plugins


def test_plugin_loads_through_entry_point():
    infos = {info.name: info for info in load_plugins().infos}
    assert "models" in infos, sorted(infos)
    assert infos["models"].distribution == "inference-engine-models"
    assert infos["models"].status == "ok", infos["models"].error


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                                  "GlmMoeDsaForCausalLM"])
def test_architecture_resolves_to_a_causal_lm(arch):
    cls = load_plugins().registry.resolve("models", arch)
    assert issubclass(cls, CausalLM) and cls.__name__ == arch
