"""The distribution is discovered through its entry point and loads cleanly."""

from inference_engine.plugins import load_plugins


def test_plugin_loads_through_entry_point():
    infos = {info.name: info for info in load_plugins().infos}
    assert "quant" in infos, sorted(infos)
    assert infos["quant"].distribution == "inference-engine-quant"
    assert infos["quant"].status == "ok", infos["quant"].error
