"""An unknown name says which installed distribution provides it, from that plugin's own hooks."""

from __future__ import annotations

import pytest
from inference_engine.plugins import get_plugins, load_plugins
from inference_engine.registry import UnknownNameError


def test_every_first_party_name_left_out_says_what_to_install():
    registered = get_plugins().registry
    core_only = load_plugins(only=["builtin"]).registry
    for kind in ("tool_parsers", "reasoning_parsers", "models", "quantization"):
        for name in registered.names(kind):
            dist = registered.get(kind, name).distribution
            if dist == "inference-engine":  # the core's built-ins stay loaded
                continue
            with pytest.raises(UnknownNameError, match=f"pip install {dist}$"):
                core_only.get(kind, name)
