"""A parser from a third-party distribution (examples/third-party-plugin) served by name."""

from __future__ import annotations

import json

import openai
import pytest

from inference_engine.testing import TEST_PLATFORM, ServerProcess, make_scripted_model

SCRIPT = ["<reflect>", "The user wants weather.", "</reflect>", "Let me look.",
          '<call name="get_weather">', '{"city": ', '"Paris"}', "</call>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("reflect"), SCRIPT)
    server = ServerProcess(model, "--tool-call-parser", "reflect_calls",
                           "--reasoning-parser", "reflect", "--enable-auto-tool-choice",
                           "--served-model-name", "m", platform=TEST_PLATFORM)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    assert server.stop() == 0, server.log()


@pytest.mark.parametrize("stream", [False, True])
def test_third_party_parsers_by_name(client, stream):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if not stream:
        out = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                             temperature=0)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        assert message.model_extra["reasoning_content"] == "The user wants weather."
        assert message.content == "Let me look."
        (call,) = message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        return
    reasoning, content, name, arguments, finish = "", "", None, "", None
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            name = tc.function.name or name
            arguments += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning.strip(), content.strip(), name) == \
        ("The user wants weather.", "Let me look.", "get_weather")
    assert json.loads(arguments) == {"city": "Paris"} and finish == "tool_calls"
