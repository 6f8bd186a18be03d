"""The distribution is discovered through its entry point and loads cleanly."""

from inference_engine.plugins import load_plugins


def test_plugin_loads_through_entry_point():
    infos = {info.name: info for info in load_plugins().infos}
    assert "xpu" in infos, sorted(infos)
    assert infos["xpu"].distribution == "inference-engine-xpu"
    assert infos["xpu"].status == "ok", infos["xpu"].error
