"""Every endpoint of the server's own ``/openapi.json`` fuzzed with schemathesis (issue 32):
valid and invalid bodies alike never get a 5xx, and every 4xx is an OpenAI error object.

Bounded (a few hundred cases on a 64-token context); ``bench/fuzz_server.py`` runs wider.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


@pytest.fixture(autouse=True)
def subnormal_floats():
    """conftest flushes denormals (for the models); hypothesis needs them to draw floats."""
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(True)


def test_no_server_errors_and_openai_shaped_client_errors(api_schema, fuzz_server):
    seen = fuzz_operations(api_schema, fuzz_server.url, EXAMPLES_PER_OPERATION)
    print(sorted(seen.items()))
    assert sum(seen.values()) >= 200
    # Every body-taking route got its share (a schema that failed to load gives one case).
    for path in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                 "POST /detokenize"):
        assert sum(n for (p, _), n in seen.items() if p == path) >= EXAMPLES_PER_OPERATION, \
            (path, sorted(seen.items()))


def sampling_fields() -> st.SearchStrategy[dict]:
    """Sampling fields in range, so that requests get served; the bad input comes from the
    prompts, messages and tool fields drawn beside them (and stop strings, which may be
    empty)."""
    text = st.text(st.characters(codec="utf-8"), max_size=12)
    return st.fixed_dictionaries({}, optional={
        "n": st.integers(1, 4),
        "max_tokens": st.integers(1, 8),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(0, 60),
        "min_p": st.floats(0, 1),
        "repetition_penalty": st.floats(0.5, 2),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.one_of(text, st.lists(text, max_size=3)),
        "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 4),
        "include_stop_str_in_output": st.booleans(),
        "stream": st.booleans(),
        "request_id": st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e),
                              min_size=1, max_size=8),
    })


@given(body=st.tuples(sampling_fields(), st.fixed_dictionaries({
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.just(""),
                        st.lists(st.integers(0, 300), max_size=8),
                        st.lists(st.integers(-1, 10**6), max_size=3)),
}, optional={"logprobs": st.integers(0, 20), "echo": st.booleans()})))
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_in_range_completions_are_served_or_refused_cleanly(fuzz_server, body):
    check_generation(fuzz_server.url, "/v1/completions", {**body[0], **body[1]})


@given(body=st.tuples(sampling_fields(), st.fixed_dictionaries({
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant", "user", "robot"]),
        "content": st.one_of(st.text(max_size=30), st.none())}), min_size=1, max_size=3)
    | st.just([]),
}, optional={"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
             "max_completion_tokens": st.integers(1, 8),
             "tools": st.just([{"type": "function", "function": {
                 "name": "f", "parameters": {"type": "object"}}}]),
             "tool_choice": st.sampled_from(["none", "auto", "required", "x",
                                             {"type": "function", "function": {"name": "f"}},
                                             {"type": "function", "function": {"name": "g"}}]),
             "chat_template_kwargs": st.dictionaries(st.sampled_from(
                 ["enable_thinking", "tokenize", "x"]), st.booleans(), max_size=2)})))
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_in_range_chats_are_served_or_refused_cleanly(fuzz_server, body):
    check_generation(fuzz_server.url, "/v1/chat/completions", {**body[0], **body[1]})


def check_generation(url: str, path: str, body: dict) -> None:
    """A 200 is a well-formed completion (or stream ending in [DONE]); else an OpenAI 4xx."""
    with httpx.stream("POST", url + path, json=body, headers=AUTH, timeout=60) as r:
        content = r.read()
    check_openai_response(r.status_code, content, r.headers.get("content-type", ""))
    if r.status_code != 200:
        return
    if body.get("stream"):
        events = [line[6:] for line in content.decode().splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("choices" in c or "error" in c for c in chunks)
    else:
        payload = json.loads(content)
        assert payload["choices"] and payload["usage"]["completion_tokens"] >= 0
