"""The distribution is discovered through its entry point and loads cleanly."""

from inference_engine.plugins import load_plugins


def test_plugin_loads_through_entry_point():
    infos = {info.name: info for info in load_plugins().infos}
    assert "gguf" in infos, sorted(infos)
    assert infos["gguf"].distribution == "inference-engine-gguf-plugin"
    assert infos["gguf"].status == "ok", infos["gguf"].error
