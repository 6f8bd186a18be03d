"""Server hardening (issue 32) through a real server process: bad input is a 400 naming
the field (never a 500, never a dropped connection), checks happen before generating,
limits refuse oversized work fast, and slow readers do not pile up output."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from inference_engine.testing import TEST_PLATFORM, ServerProcess

KEY = "hardening-key"
ORIGIN = "http://allowed.example"
NAME = "tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    proc = ServerProcess(tiny_model_dirs["qwen3"], "--served-model-name", NAME,
                         "--api-key", KEY, "--enable-auth", "--enable-cors",
                         "--cors-allow-origins", ORIGIN, "--enable-auto-tool-choice",
                         "--max-num-seqs", "32", platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}", "Origin": ORIGIN}) as c:
        yield c


def gauges(http) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("inference_engine:") and "{" in line:
            out[line.split("{", 1)[0].removeprefix("inference_engine:")] = \
                float(line.rsplit(" ", 1)[1])
    return out


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == status and isinstance(error["message"], str) and error["type"]
    return error


def raw_exchange(server, requests: list[bytes]) -> list[bytes]:
    """Send requests one after another on one keep-alive socket; the raw responses."""
    out = []
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        for request in requests:
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += sock.recv(65536)
            out.append(head + b"\r\n\r\n" + body)
    return out


def post(path: str, body: dict, *headers: str) -> bytes:
    data = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             f"Content-Length: {len(data)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


# ---- 1 and 8: tool_choice and tools are checked before anything is generated ------
@pytest.mark.parametrize("choice", ["sometimes", 5, {"type": "function"},
                                    {"type": "function", "function": {"name": 3}}])
def test_invalid_tool_choice_is_a_400_with_cors(http, choice):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS,
                                                "tool_choice": choice, "max_tokens": 4})
    assert_error(r, 400, "tool_choice")
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_an_error_keeps_the_keep_alive_connection_usable(server):
    auth = f"Authorization: Bearer {KEY}"
    bad = post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS,
                                        "tool_choice": "sometimes"}, auth)
    good = post("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, auth)
    first, second = raw_exchange(server, [bad, good])
    assert first.startswith(b"HTTP/1.1 400") and b"connection: close" not in first.lower()
    assert second.startswith(b"HTTP/1.1 200"), second


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_naming_a_missing_tool_is_refused_up_front(http, stream):
    before = gauges(http)["generation_tokens_total"]
    r = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "max_tokens": 50, "stream": stream,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    error = assert_error(r, 400, "tool_choice")
    assert "get_time" in error["message"] and "get_weather" in error["message"]
    assert gauges(http)["generation_tokens_total"] == before


@pytest.mark.parametrize("parameters", ["notaschema", 7, ["object"], {"type": "thing"},
                                        {"type": "object", "properties": []},
                                        {"type": "object", "required": "city"}])
def test_tool_parameters_must_be_a_json_schema_object(http, parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools,
                                                "max_tokens": 2})
    assert_error(r, 400, "tools")


# ---- 2: request_id goes into a header, so it is checked -----------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("rid", ["caf\u00e9", "snow\u2603man", "a\r\nX-Evil: 1", "nul\x00",
                                 "with space", "", "x" * 257])
def test_bad_request_ids_are_a_400_and_run_nothing(http, rid, stream):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 64,
                                           "ignore_eos": True, "request_id": rid,
                                           "stream": stream})
    assert_error(r, 400, "request_id")
    stats = gauges(http)
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0


def test_a_good_request_id_is_echoed(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                           "request_id": "my-id_1.2:3"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id_1.2:3"


# ---- 9: small things ------------------------------------------------------------
def test_max_completion_tokens_errors_name_that_field(http):
    for value in (10**9, 0):
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                    "max_completion_tokens": value})
        error = assert_error(r, 400, "max_completion_tokens")
        assert value or error["message"].startswith("max_completion_tokens")


def test_unknown_model_is_a_404_with_a_snake_case_type(http):
    r = http.post("/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 1})
    assert assert_error(r, 404, "model")["type"] == "not_found_error"


def test_head_health(server):
    r = httpx.head(server.url + "/health")
    assert r.status_code == 200


def test_duplicate_authorization_headers_are_refused(server):
    headers = httpx.Headers([("Authorization", f"Bearer {KEY}"),
                             ("Authorization", "Bearer wrong")])
    r = httpx.get(server.url + "/v1/models", headers=headers)
    assert_error(r, 400, None)
    swapped = httpx.Headers([("Authorization", "Bearer wrong"),
                             ("Authorization", f"Bearer {KEY}")])
    assert httpx.get(server.url + "/v1/models", headers=swapped).status_code == 400


def test_openapi_schema_is_served_behind_auth_and_describes_bodies(server, http):
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    schema = http.get("/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert "prompt" in body["content"]["application/json"]["schema"]["properties"]


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"tools": 3}, {"conversation": 1},
                                    {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}])
def test_reserved_chat_template_kwargs_are_named(http, kwargs):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                "chat_template_kwargs": kwargs})
    error = assert_error(r, 400, "chat_template_kwargs")
    assert next(iter(kwargs)) in error["message"] and "transformers" not in error["message"]


# ---- 3: oversized text is refused before tokenizing, off the event loop ---------
def test_oversized_bodies_and_prompts_are_refused_fast(server, http):
    began = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "word " * 1_000_000, "max_tokens": 1})
    assert r.status_code == 413, r.text
    assert time.monotonic() - began < 5
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    # Within the body limit but more characters than the context could hold
    # (every token of the tiny vocabulary is far shorter than 64 characters).
    text = "z" * (max_model_len * 64 * 4 + 1)
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    if r.status_code == 413:  # the body bound is below this text: also refused unread
        return
    assert_error(r, 400, "prompt")
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                              "content": text}]})
    assert_error(r, 400, "messages")
    tools = [{"type": "function", "function": {"name": "f", "description": text}}]
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools})
    assert_error(r, 400, "tools")
    assert httpx.get(server.url + "/health", timeout=1).status_code == 200


# ---- 4: stop strings are bounded and matched incrementally -----------------------
def test_stop_string_limits(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "stop": ["a"] * 65})
    assert_error(r, 400, "stop")
    r = http.post("/v1/completions", json={"prompt": "Hi", "stop": "a" * 1025})
    assert_error(r, 400, "stop")


def test_many_long_stop_strings_still_stream_exact_text(http):
    body = {"prompt": "The quick brown", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # Never matched, but each one's prefix keeps matching the text's tail.
    stops = [plain[:40] + "\u2603" * 900 + str(i) for i in range(64)]
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stop": stops,
                                                      "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- 6: a slow reader holds one pending output, not one per step ------------------
def test_a_reader_that_waits_gets_the_same_text(server, http):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "n": 4,
            "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    expected = sorted((c["index"], c["text"]) for c in whole["choices"])
    texts = ["" for _ in range(4)]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        for choice in json.loads(first[6:])["choices"]:
            texts[choice["index"]] += choice["text"]
        # Stop reading until the engine is done with the request.
        deadline = time.monotonic() + 60
        while gauges(http)["num_requests_running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    for chunk in rest:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    # Whatever was merged while the reader waited (socket buffers take the first
    # ~100 KB), nothing is lost or repeated.
    assert sorted(enumerate(texts)) == expected


def test_async_llm_coalesces_unread_outputs(tiny_model_dirs):
    from inference_engine import SamplingParams
    from inference_engine.engine.async_client import AsyncLLM

    engine = AsyncLLM.from_model(str(tiny_model_dirs["qwen3"]), platform=TEST_PLATFORM,
                                 kv_cache_memory=16 << 20)

    async def run() -> tuple[list, list]:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        eager = [o async for o in engine.generate("Hello there", params)]
        stream = await engine.add_request("Hello there", params)
        while await engine.request_ids():
            await asyncio.sleep(0.05)
        late = [o async for o in stream]
        return eager, late

    try:
        eager, late = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(eager) > 1 and len(late) == 1
    assert late[0].finished and late[0].outputs[0].text == eager[-1].outputs[0].text
    assert late[0].outputs[0].token_ids == eager[-1].outputs[0].token_ids


# ---- 1: an unexpected exception is a well-formed 500 inside CORS ------------------
def test_unhandled_errors_become_openai_500s_with_cors_headers():
    from inference_engine.entrypoints.openai.errors import InternalErrorMiddleware
    from starlette.applications import Starlette
    from starlette.middleware.cors import CORSMiddleware
    from starlette.routing import Route

    async def broken(request):
        raise KeyError("internal detail")

    app = Starlette(routes=[Route("/broken", broken)])
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=[ORIGIN])

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/broken", headers={"Origin": ORIGIN})

    r = asyncio.run(call())
    error = assert_error(r, 500, None)
    assert error["type"] == "server_error" and "KeyError" in error["message"]
    assert "internal detail" not in error["message"]
    assert r.headers["access-control-allow-origin"] == ORIGIN
