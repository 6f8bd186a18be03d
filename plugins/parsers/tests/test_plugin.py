"""The distribution is discovered through its entry point and loads cleanly."""

from inference_engine.plugins import load_plugins


def test_plugin_loads_through_entry_point():
    infos = {info.name: info for info in load_plugins().infos}
    assert "parsers" in infos, sorted(infos)
    assert infos["parsers"].distribution == "inference-engine-parsers"
    assert infos["parsers"].status == "ok", infos["parsers"].error
