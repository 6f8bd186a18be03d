"""The install hints in ``KNOWN_PROVIDERS`` stay true for the parsers distribution."""

from __future__ import annotations

from inference_engine.plugins import get_plugins
from inference_engine.registry import KNOWN_PROVIDERS


def test_every_hinted_parser_is_registered_by_the_named_distribution():
    registry = get_plugins().registry
    hinted = {(kind, name) for (kind, name), dist in KNOWN_PROVIDERS.items()
              if dist == "inference-engine-parsers"}
    registered = {(kind, name) for kind in ("tool_parsers", "reasoning_parsers")
                  for name in registry.names(kind)}
    assert hinted <= registered
    # And every first-party parser name has a hint, so an uninstalled one says what to install.
    first_party = {(kind, name) for kind, name in registered
                   if registry.get(kind, name).distribution == "inference-engine-parsers"}
    assert first_party <= hinted
