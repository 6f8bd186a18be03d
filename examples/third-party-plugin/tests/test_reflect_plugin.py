"""The example plugin is discovered, listed and usable with no change to core."""

import json
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from inference_engine.plugins import load_plugins

SAMPLE = "Sure.<reflect>The user wants x; check y.</reflect>The answer is 42."


def test_discovered_through_entry_point_and_resolvable():
    plugin_set = load_plugins()
    info = {i.name: i for i in plugin_set.infos}["reflect"]
    assert info.status == "ok"
    assert info.distribution == "ie-reflect-parser"
    assert info.provides["reasoning_parsers"] == ["reflect"]
    parser_cls = plugin_set.registry.resolve("reasoning_parsers", "reflect")
    assert parser_cls().parse(SAMPLE) == ("The user wants x; check y.", "Sure.The answer is 42.")


def test_listed_by_cli():
    out = subprocess.run(
        [sys.executable, "-m", "inference_engine.cli", "list-plugins", "--json",
         "--kind", "reasoning_parsers"],
        check=True, capture_output=True, text=True,
    ).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["reflect"]["provides"]["reasoning_parsers"] == ["reflect"]


@given(st.lists(st.integers(min_value=0, max_value=len(SAMPLE)), max_size=8))
def test_any_chunking_gives_the_same_split(cuts):
    parser_cls = load_plugins().registry.resolve("reasoning_parsers", "reflect")
    parser = parser_cls()
    bounds = [0, *sorted(cuts), len(SAMPLE)]
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:]):
        delta = parser.feed(SAMPLE[a:b])
        # SAMPLE has no "<" outside markers, so any "<" here is a leaked marker fragment
        assert "<" not in delta.reasoning + delta.content
        reasoning += delta.reasoning
        content += delta.content
    tail = parser.finish()
    reasoning += tail.reasoning
    content += tail.content
    assert (reasoning, content) == ("The user wants x; check y.", "Sure.The answer is 42.")
