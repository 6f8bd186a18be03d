"""The distribution is discovered through its entry point and loads cleanly."""

from inference_engine.plugins import load_plugins


def test_plugin_loads_through_entry_point():
    infos = {info.name: info for info in load_plugins().infos}
    assert "parsers" in infos, sorted(infos)
    assert infos["parsers"].distribution == "inference-engine-parsers"
    assert infos["parsers"].status == "ok", infos["parsers"].error


TOOL_PARSERS = ["deepseek_v31", "glm45", "glm47", "minimax_m2", "nemotron_v2", "nemotron_v3",
                "qwen3", "qwen3_coder"]
REASONING_PARSERS = ["deepseek_r1", "deepseek_v3", "glm45", "minimax_m2",
                     "minimax_m2_append_think", "nemotron_v3", "qwen3"]


def test_registers_exactly_the_spec_names_and_each_resolves():
    from inference_engine.interfaces.parsers import ReasoningParser, ToolParser

    plugin_set = load_plugins()
    info = {i.name: i for i in plugin_set.infos}["parsers"]
    assert sorted(info.provides["tool_parsers"]) == TOOL_PARSERS
    assert sorted(info.provides["reasoning_parsers"]) == REASONING_PARSERS
    for name in TOOL_PARSERS:
        assert issubclass(plugin_set.registry.resolve("tool_parsers", name), ToolParser)
    for name in REASONING_PARSERS:
        assert issubclass(plugin_set.registry.resolve("reasoning_parsers", name), ReasoningParser)


def test_plugin_module_imports_no_parser_code():
    import subprocess
    import sys

    code = ("import sys, inference_engine_parsers.plugin; "
            "print(sorted(m for m in sys.modules if m.startswith('inference_engine_parsers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['inference_engine_parsers', 'inference_engine_parsers.plugin']"
