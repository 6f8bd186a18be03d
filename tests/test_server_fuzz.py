"""Every endpoint of the server's own ``/openapi.json`` fuzzed with schemathesis (issue 32):
valid and invalid bodies alike never get a 5xx, and every 4xx is an OpenAI error object.

Bounded (a few hundred cases on a 64-token context); ``bench/fuzz_server.py`` runs wider.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from inference_engine.testing import TEST_PLATFORM, ServerProcess

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dirs):
    proc = ServerProcess(tiny_model_dirs["qwen3"], "--api-key", KEY, "--enable-auth",
                         "--max-model-len", "64", "--max-num-seqs", "16",
                         platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=AUTH,
                                         timeout=30)


def check_openai_response(status: int, body: bytes, content_type: str) -> None:
    """No 5xx; a 4xx carries ``{"error": {"message", "type", "param", "code"}}``."""
    assert status < 500, body[:2000]
    if status >= 400:
        assert content_type.startswith("application/json"), content_type
        error = httpx.Response(status, content=body).json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] == status


def fuzz_operations(schema: schemathesis.BaseSchema, url: str,
                    examples: int) -> Counter[tuple[str, int]]:
    """Run up to ``examples`` valid and as many invalid cases per operation.

    Returns:
        How many answers each ("METHOD path", status) got.
    """
    seen: Counter[tuple[str, int]] = Counter()

    def run(case: schemathesis.Case) -> None:
        try:
            response = case.call(base_url=url, headers=AUTH, timeout=60)
        finally:
            if case.path == "/pause":  # a paused engine would hold every later case
                httpx.post(url + "/resume", headers=AUTH, timeout=30)
        seen[f"{case.method} {case.path}", response.status_code] += 1
        content_type = response.headers.get("content-type") or [""]
        check_openai_response(response.status_code, response.content, content_type[0])

    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(operation.as_strategy(generation_mode=mode))
            def one(case: schemathesis.Case) -> None:
                run(case)

            try:
                one()
            except Unsatisfiable:  # no invalid input exists (a GET without parameters)
                assert mode is schemathesis.GenerationMode.NEGATIVE
    return seen


def test_no_server_errors_and_openai_shaped_client_errors(api_schema, fuzz_server):
    # conftest flushes denormals (for the models); hypothesis needs them to draw floats.
    torch.set_flush_denormal(False)
    try:
        seen = fuzz_operations(api_schema, fuzz_server.url, EXAMPLES_PER_OPERATION)
    finally:
        torch.set_flush_denormal(True)
    print(sorted(seen.items()))
    assert sum(seen.values()) >= 200
    # Every body-taking route got its share (a schema that failed to load gives one case).
    for path in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                 "POST /detokenize"):
        assert sum(n for (p, _), n in seen.items() if p == path) >= EXAMPLES_PER_OPERATION, \
            (path, sorted(seen.items()))
