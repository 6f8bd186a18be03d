"""The OpenAI server end to end: a real subprocess on a loopback port, driven by the
official ``openai`` client and ``httpx``; references are the tokenizer itself and the
same requests run one at a time."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from inference_engine.testing import TEST_PLATFORM, ServerProcess

KEYS = ("key-one", "key-two")
ORIGIN = "http://allowed.example"
NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    proc = ServerProcess(tiny_model_dirs["qwen3"], "--served-model-name", NAME,
                         "--api-key", KEYS[0], "--enable-auth", "--enable-cors",
                         "--cors-allow-origins", ORIGIN, "--max-num-seqs", "64",
                         env={"INFERENCE_ENGINE_API_KEY": KEYS[1]}, platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs):
    return AutoTokenizer.from_pretrained(tiny_model_dirs["qwen3"])


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client(server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    out = {}
    for line in text.splitlines():
        if line.startswith("inference_engine:") and "{" in line:
            name = line.split("{", 1)[0].removeprefix("inference_engine:")
            if 'finished_reason="' in line:
                name += ":" + line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ---- the OpenAI endpoints through the official client --------------------------
def test_models_lists_served_name(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [NAME]


def test_completion_whole_and_streamed_agree(server):
    c = client(server)
    whole = c.completions.create(model=NAME, prompt="The quick brown", max_tokens=12,
                                 temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    stream = c.completions.create(model=NAME, prompt="The quick brown", max_tokens=12,
                                  temperature=0, stream=True,
                                  stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_whole_and_streamed_agree(server, tokenizer):
    c = client(server)
    messages = [{"role": "user", "content": "Paged attention stores keys"}]
    whole = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_seed_stop_and_logprobs(server):
    c = client(server)
    out = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, n=3,
                               temperature=1.0, seed=7, logprobs=2,
                               extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.0,
                                           "repetition_penalty": 1.1})
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2]
    again = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, n=3,
                                 temperature=1.0, seed=7, logprobs=2,
                                 extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.0,
                                             "repetition_penalty": 1.1})
    assert [ch.text for ch in out.choices] == [ch.text for ch in again.choices]
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
        assert all(v <= 0 for v in lp.token_logprobs)
    greedy = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=16,
                                  temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    if len(text) > 4:
        stop = text[2:4]
        cut = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=16,
                                   temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[:text.index(stop)]
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                     max_completion_tokens=4, temperature=0, logprobs=True,
                                     top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)


def test_several_prompts_echo_and_token_prompts(server, tokenizer):
    c = client(server)
    ids = tokenizer.encode("The quick brown")
    out = c.completions.create(model=NAME, prompt=["The quick brown", "Once upon"], n=2,
                               max_tokens=5, temperature=0, echo=True,
                               extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("The quick brown")
    assert out.choices[2].text.startswith("Once upon")
    assert out.choices[0].text == out.choices[1].text  # greedy: both samples agree
    by_ids = c.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert "The quick brown" + by_ids.choices[0].text == out.choices[0].text
    assert out.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Once upon"))
    assert out.usage.completion_tokens == 20


def test_64_concurrent_streams_match_one_by_one(server):
    prompts = [f"Continuous batching mixes {i} prefill chunks" * (1 + i % 3) for i in range(64)]
    body = {"temperature": 0, "max_tokens": 12, "logprobs": 0}
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    c = client(server)

    def ids(choice_logprobs) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in choice_logprobs.tokens]

    sequential = []
    for p in prompts:
        out = c.completions.create(model=NAME, prompt=p, extra_body=extra, **body)
        sequential.append(ids(out.choices[0].logprobs))

    async def run_all() -> list[list[int]]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0,
                                timeout=300)

        async def one(p: str) -> list[int]:
            tokens: list[int] = []
            finish = None
            stream = await ac.completions.create(model=NAME, prompt=p, stream=True,
                                                 extra_body=extra, **body)
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.logprobs is not None:
                        tokens += ids(choice.logprobs)
                    finish = choice.finish_reason or finish
            assert finish == "length"
            return tokens

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await ac.close()

    concurrent = asyncio.run(run_all())
    assert concurrent == sequential


# ---- tokenizer endpoints ---------------------------------------------------------
def test_tokenize_detokenize_round_trip(server, tokenizer):
    text = "héllo wörld, naïve café 🎉"
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=auth())
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    r = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, headers=auth())
    assert r.json()["prompt"] == tokenizer.decode(body["tokens"]) == text
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=auth())
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)


# ---- auth and CORS -------------------------------------------------------------------
PROTECTED = [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/is_paused", None), ("POST", "/abort_requests", {"request_ids": ["none"]}),
    ("GET", "/version", None), ("GET", "/metrics", None),
    ("POST", "/pause", None), ("POST", "/resume", None),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_auth_refuses_and_accepts(server, method, path, body):
    url = server.url + path
    for headers in ({}, auth("wrong"), {"Authorization": KEYS[0]}):
        r = httpx.request(method, url, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        error = r.json()["error"]
        assert error["code"] == 401 and error["type"] == "authentication_error" and error["message"]
    for key in KEYS:
        r = httpx.request(method, url, json=body, headers=auth(key))
        assert r.status_code == 200, r.text


def test_health_needs_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client_with_wrong_key_gets_authentication_error(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, "nope").models.list()


def test_cors_preflight_and_headers(server):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    bad = httpx.options(server.url + "/v1/chat/completions",
                        headers={"Origin": "http://evil.example", **preflight})
    assert bad.status_code == 400
    assert "access-control-allow-origin" not in bad.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN, **auth()})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example", **auth()})
    assert "access-control-allow-origin" not in r.headers
    # A refused key still carries CORS headers, so a browser can read the 401.
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


# ---- pause, abort, disconnect ----------------------------------------------------------
def _stream_lines(server, body: dict, out: list, started: threading.Event | None = None):
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers=auth(), timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                if started is not None:
                    started.set()


def test_pause_holds_in_flight_and_queues_new_until_resume(server):
    long = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    results: list[list] = [[] for _ in range(4)]
    started = threading.Event()
    threads = [threading.Thread(target=_stream_lines, args=(server, long, results[0], started))]
    threads[0].start()
    assert started.wait(60)
    assert httpx.post(server.url + "/pause", headers=auth()).json() == {"paused": True}
    assert httpx.get(server.url + "/is_paused", headers=auth()).json() == {"is_paused": True}
    for i in range(1, 4):
        t = threading.Thread(target=_stream_lines, args=(server, {**long, "max_tokens": 5},
                                                         results[i]))
        t.start()
        threads.append(t)
    wait_for(lambda: metrics(server)["num_requests_waiting"] == 3, what="3 queued requests")
    held = len(results[0])
    time.sleep(0.5)
    assert len(results[0]) == held, "a paused engine kept generating"
    assert all(not r for r in results[1:])
    assert httpx.post(server.url + "/resume", headers=auth()).json() == {"paused": False}
    for t in threads:
        t.join(120)
    for r, expected in zip(results, (200, 5, 5, 5), strict=True):
        assert r[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for ch in r for _ in ch["choices"]) <= expected + 1


def test_abort_requests_during_16_streams(server):
    results: list[list] = [[] for _ in range(16)]
    events = [threading.Event() for _ in range(16)]
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    threads = [threading.Thread(target=_stream_lines, args=(server, body, results[i], events[i]))
               for i in range(16)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60)
    # The event loop is not blocked by the engine working on 16 sequences.
    began = time.monotonic()
    assert httpx.get(server.url + "/health").status_code == 200
    assert time.monotonic() - began < 1.0
    assert metrics(server)["kv_cache_usage_perc"] > 0
    r = httpx.post(server.url + "/abort_requests", json={}, headers=auth())
    assert r.status_code == 200 and len(r.json()["aborted"]) == 16
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    for r in results:
        assert r[-1]["choices"][0]["finish_reason"] == "abort"
    m = wait_for(lambda: (m := metrics(server))["kv_cache_usage_perc"] == 0 and m, what="KV free")
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0


def test_abort_one_request_by_id(server):
    out: list = []
    started = threading.Event()
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True,
            "request_id": "mine-1"}
    t = threading.Thread(target=_stream_lines, args=(server, body, out, started))
    t.start()
    assert started.wait(60)
    r = httpx.post(server.url + "/abort_requests", json={"request_ids": ["mine-1", "other"]},
                   headers=auth())
    assert r.json()["aborted"] == ["mine-1"]
    t.join(30)
    assert out[-1]["choices"][0]["finish_reason"] == "abort"
    assert out[0]["id"] == "mine-1"


def test_disconnecting_client_frees_its_blocks(server):
    aborts = metrics(server).get("request_success_total:abort", 0)
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(),
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    # Non-streaming too: the request is cancelled when its client goes away.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "n": 4},
                   headers=auth(), timeout=0.25)
    m = wait_for(lambda: (m := metrics(server))["num_requests_running"] == 0 and m,
                 what="requests of gone clients to end")
    assert m["kv_cache_usage_perc"] == 0
    # Both requests ended as aborted, long before their 480 tokens.
    assert m["request_success_total:abort"] == aborts + 2


# ---- bad input ---------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": 5}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": [10**9]}, 400),
    ("/v1/completions", {"prompt": "a", "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**9}, 400),
    ("/v1/completions", {"prompt": "word " * 600}, 400),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400),
    ("/v1/completions", {"prompt": "a", "n": 10**6}, 400),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "a", "logprobs": 1000}, 400),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400),
    (CHAT, {"messages": []}, 400),
    (CHAT, {"messages": "hi"}, 400),
    (CHAT, {"messages": [{"content": "no role"}]}, 400),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("/tokenize", {}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/abort_requests", {"request_ids": "all"}, 400),
    ("/no/such/path", {}, 404),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_clear_openai_error(server, path, body, status):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={**auth(), "Content-Type": "application/json"},
                   **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"], error
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client(server).completions.create(model=NAME, prompt="a", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="gpt-4", prompt="a")


def test_metrics_exposition(server):
    # One request of its own: the counters must not depend on which tests ran before.
    client(server).completions.create(model=NAME, prompt="The quick brown", max_tokens=3)
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hit_rate", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket"):
        assert f"inference_engine:{name}" in text
    m = metrics(server)
    assert m["prompt_tokens_total"] > 0 and m["generation_tokens_total"] > 0
    assert 0 <= m["prefix_cache_hit_rate"] <= 1


def test_version(server):
    from inference_engine import __version__

    assert httpx.get(server.url + "/version", headers=auth()).json() == {"version": __version__}

