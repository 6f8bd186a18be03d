"""Plugin loading: broken plugins, clashes, overrides, filters, unknown names, firstresult."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from inference_engine import Spec, hookimpl
from inference_engine.plugins import load_plugins, module_with_hooks
from inference_engine.registry import RemovedArchitectureError, UnknownNameError


def _parser_plugin(name: str, parser: str, overrides: str | None = None):
    @hookimpl
    def ie_register_reasoning_parsers():
        return [Spec(parser, "ie_reflect_parser.parser:ReflectReasoningParser",
                     "test parser", overrides=overrides)]

    return module_with_hooks(name, ie_register_reasoning_parsers=ie_register_reasoning_parsers)


def test_broken_import_is_recorded_and_others_still_load():
    def broken():
        raise ImportError("no module named 'missing_dependency'")

    class BrokenLoader:
        # An object whose hook raises at registration time.
        @hookimpl
        def ie_register_models(self):
            raise RuntimeError("registration exploded")

    plugin_set = load_plugins(extra={"exploding": BrokenLoader(),
                                     "good": _parser_plugin("good", "good_parser")})
    infos = {i.name: i for i in plugin_set.infos}
    assert infos["exploding"].status == "error"
    assert "registration exploded" in infos["exploding"].error
    assert infos["good"].status == "ok"
    assert infos["builtin"].status == "ok"
    assert "good_parser" in plugin_set.registry.names("reasoning_parsers")
    assert plugin_set.errors() == [infos["exploding"]]
    del broken


def test_entry_point_that_fails_to_import_is_reported(monkeypatch):
    import inference_engine.plugins as plugins_module

    real = plugins_module._discover

    def with_broken():
        def fail():
            raise ModuleNotFoundError("No module named 'not_installed_dep'")

        return [*real(), ("broken", "broken-dist", "9.9", "broken.plugin", fail)]

    monkeypatch.setattr(plugins_module, "_discover", with_broken)
    plugin_set = load_plugins()
    infos = {i.name: i for i in plugin_set.infos}
    assert infos["broken"].status == "error"
    assert "not_installed_dep" in infos["broken"].error
    assert infos["reflect"].status == "ok"
    assert plugin_set.registry.resolve("reasoning_parsers", "reflect") is not None


def test_duplicate_name_is_refused_naming_both():
    plugin_set = load_plugins(extra={"clash": _parser_plugin("clash", "reflect")})
    info = {i.name: i for i in plugin_set.infos}["clash"]
    assert info.status == "error"
    assert "'reflect'" in info.error and "'clash'" in info.error
    assert "ie-reflect-parser" in info.error
    # The original registration survives.
    assert plugin_set.registry.get("reasoning_parsers", "reflect").plugin == "reflect"


def test_overrides_replaces_the_named_plugin():
    plugin_set = load_plugins(
        extra={"mine": _parser_plugin("mine", "reflect", overrides="reflect")})
    assert {i.name: i for i in plugin_set.infos}["mine"].status == "ok"
    assert plugin_set.registry.get("reasoning_parsers", "reflect").plugin == "mine"


def test_filter_restricts_loading_and_rejects_unknown_names():
    plugin_set = load_plugins(only=["builtin"])
    assert [i.name for i in plugin_set.infos] == ["builtin"]
    assert plugin_set.registry.names("platforms") == ["cpu", "cuda"]
    with pytest.raises(ValueError, match="no_such_plugin"):
        load_plugins(only=["builtin", "no_such_plugin"])


def test_unknown_name_lists_registered_and_install_hint():
    registry = load_plugins(only=["builtin"]).registry
    with pytest.raises(UnknownNameError) as err:
        registry.get("weight_formats", "gguf")
    assert "pip install inference-engine-gguf-plugin" in str(err.value)
    with pytest.raises(UnknownNameError, match="registered: cpu, cuda"):
        registry.get("platforms", "tpu")
    with pytest.raises(RemovedArchitectureError, match="removed"):
        registry.get("models", "Dots1ForCausalLM")


def test_firstresult_decision_hook_first_answer_wins():
    @hookimpl
    def ie_kernel_tuning_config(op_name, platform, shape):
        return {"BLOCK_SIZE_M": 16} if op_name == "fused_moe" else None

    plugin_set = load_plugins(
        extra={"tuner": module_with_hooks("tuner", ie_kernel_tuning_config=ie_kernel_tuning_config)})
    hook = plugin_set.hook.ie_kernel_tuning_config
    assert hook(op_name="fused_moe", platform=None, shape={"M": 1}) == {"BLOCK_SIZE_M": 16}
    assert hook(op_name="other", platform=None, shape={"M": 1}) is None


def _cli(*args: str, env_plugins: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("INFERENCE_ENGINE_PLUGINS", None)
    if env_plugins is not None:
        env["INFERENCE_ENGINE_PLUGINS"] = env_plugins
    return subprocess.run([sys.executable, "-m", "inference_engine.cli", *args],
                          capture_output=True, text=True, env=env)


def test_cli_json_lists_every_first_party_plugin_ok():
    result = _cli("list-plugins", "--json", "--strict")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    expected = {"builtin": "inference-engine", "models": "inference-engine-models",
                "quant": "inference-engine-quant", "parsers": "inference-engine-parsers",
                "gguf": "inference-engine-gguf-plugin", "rocm": "inference-engine-rocm",
                "xpu": "inference-engine-xpu", "reflect": "ie-reflect-parser"}
    for name, dist in expected.items():
        assert rows[name]["distribution"] == dist
        assert rows[name]["status"] == "ok" and rows[name]["error"] is None
        assert set(rows[name]) == {"name", "distribution", "version", "module", "status",
                                   "error", "provides"}
    assert "cpu" in rows["builtin"]["provides"]["platforms"]


def test_cli_core_only_still_lists_builtins():
    result = _cli("list-plugins", env_plugins="builtin")
    assert result.returncode == 0, result.stderr
    assert "builtin" in result.stdout and "cpu" in result.stdout
    assert "reflect" not in result.stdout


def test_cli_unknown_plugin_filter_and_kind_exit_2():
    assert _cli("list-plugins", env_plugins="nope").returncode == 2
    assert _cli("list-plugins", "--kind", "bogus").returncode == 2


def test_cli_version():
    result = _cli("--version")
    assert result.returncode == 0 and "inference-engine" in result.stdout


def test_plugin_docs_are_current():
    """docs/plugins.md's hook reference matches the hookspec docstrings."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "scripts" / "gen_plugin_docs.py"
    assert subprocess.run([sys.executable, str(script), "--check"]).returncode == 0, (
        "run scripts/gen_plugin_docs.py"
    )


def test_quant_option_a_method_does_not_take_is_refused_by_name(tmp_path):
    from inference_engine.cli_values import parse_key_values
    from inference_engine.testing import cpu_llm, make_tiny_model

    path = make_tiny_model(tmp_path / "m")
    with pytest.raises(ValueError, match=r"'unquantized' has no option 'activations'.*takes: none"):
        cpu_llm(str(path), show_progress=False, kv_cache_memory=1 << 22,
            quant_options={"activations": "q8"})
    assert parse_key_values(["a=1", " b = x=y "], "--flag") == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError, match="--flag takes KEY=VALUE, got '=1'"):
        parse_key_values(["=1"], "--flag")
