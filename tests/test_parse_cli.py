"""`inference-engine parse`: a saved Qwen3 output parsed whole and streamed give the same JSON."""

from __future__ import annotations

import json
import subprocess
import sys

OUTPUT = (
    "<think>plan it</think>Sure.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
EXPECTED = {
    "reasoning": "plan it",
    "content": "Sure.",
    "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}],
}


def parse(*args: str, stdin: str = OUTPUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inference_engine.cli", "parse", *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def test_parse_whole_and_streamed_agree_with_the_format():
    for extra in ([], ["--chunk-size", "1"], ["--chunk-size", "7"], ["--stream-random", "3"],
                  ["--stream-random", "4", "--tool-call-streaming", "whole"]):
        result = parse("--tool-parser", "qwen3", "--reasoning-parser", "qwen3", *extra)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == EXPECTED, extra


def test_parse_bad_names_exit_2():
    result = parse("--tool-parser", "nope")
    assert result.returncode == 2 and "nope" in result.stderr and "qwen3" in result.stderr
    assert parse().returncode == 2
