"""Tool calls and reasoning through the server, from a model whose greedy output is a
known Qwen3-format script (a real checkpoint with bigram weights, see
``make_scripted_model``); the expected message is what the spec says that text means."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from inference_engine.testing import TEST_PLATFORM, ServerProcess, make_scripted_model

SCRIPT = ["<think>", "Let me", " check the weather.", "</think>", "\n\n", "Sure.",
          "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": ',
          '"Paris", "days": 3}}', "\n</tool_call>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("scripted"), SCRIPT)
    # No parser named: --enable-auto-tool-choice picks qwen3/qwen3 from the architecture.
    proc = ServerProcess(model, "--enable-auto-tool-choice", platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_whole_response_has_reasoning_content_and_tool_call(client):
    out = client.chat.completions.create(model=client.models.list().data[0].id,
                                         messages=MESSAGES, tools=TOOLS, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == "Sure."
    assert message.model_extra["reasoning_content"] == "Let me check the weather."
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_streamed_deltas_add_up_to_the_whole_response(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                            temperature=0, stream=True)
    reasoning, content, calls, finish = "", "", {}, None
    headers = 0
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                headers += 1
                entry["id"], entry["name"] = tc.id, tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning.strip() == "Let me check the weather."
    assert content.strip() == "Sure."
    assert headers == 1 and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}


def test_tool_choice_none_leaves_the_call_as_content(client):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="none", temperature=0)
    message = out.choices[0].message
    assert not message.tool_calls and out.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "Let me check the weather."
    assert message.content == "".join(SCRIPT[4:]).strip()


def test_named_tool_choice_is_forced_by_a_grammar(client):
    model = client.models.list().data[0].id
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC"]}}, "required": ["tz"],
        "additionalProperties": False}}}
    # The script would call get_weather; the grammar of the qwen3 format forces get_time
    # (after the reasoning section, which stays free).
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[*TOOLS, other], temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {
        "tz": "UTC"}
    assert out.choices[0].message.model_extra["reasoning_content"] == "Let me check the weather."
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, temperature=0, tool_choice="required")
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tool_results_go_back_through_the_chat_template(server, client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow_up = [*MESSAGES,
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name,
                                               "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": follow_up})
    detok = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]})
    assert "sunny, 21 C" in detok.json()["prompt"]
    out = client.chat.completions.create(model=model, messages=follow_up, tools=TOOLS,
                                         temperature=0)
    assert out.choices[0].message.tool_calls


def test_no_cors_headers_without_enable_cors(server):
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://a.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + "/v1/models",
                      headers={"Origin": "http://a.example",
                               "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers
