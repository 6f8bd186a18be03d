"""The committed demo model (models/demo-qwen3-tiny) still does what `make demo` shows.

Greedy decoding through ``LLM.chat`` with the ``qwen3`` tool and reasoning
parsers must think, call ``get_weather`` with arguments that satisfy its JSON
schema, and answer from the tool result; and the engine's greedy tokens must
equal transformers' greedy tokens on the same checkpoint (the reference), so an
engine, template or parser regression that breaks the demo fails here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from inference_engine.testing import TEST_PLATFORM, cpu_llm
from inference_engine.parsing import parse_output
from inference_engine.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO_ROOT / "models" / "demo-qwen3-tiny"
GREEDY = SamplingParams(temperature=0.0, max_tokens=160)


def _load_demo_tools():
    path = REPO_ROOT / "scripts" / "demo_tools.py"
    spec = importlib.util.spec_from_file_location("demo_tools", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo_tools = _load_demo_tools()


@pytest.fixture(scope="module")
def llm():
    return cpu_llm(str(MODEL_DIR), dtype="float32", kv_cache_memory=16 << 20, show_progress=False)


def _chat(llm, messages, tools=None):
    out = llm.chat(messages, GREEDY, tools=tools, use_tqdm=False)[0].outputs[0]
    return out, parse_output(out.text, "qwen3", "qwen3", tools=tools)


def test_plain_question_gets_reasoning_and_an_answer(llm):
    _, result = _chat(llm, [{"role": "user", "content": demo_tools.DEMO_PLAIN_QUESTION}])
    assert result.reasoning and "France" in result.reasoning
    assert result.content == "The capital of France is Paris."
    assert result.tool_calls == []


def test_tool_question_thinks_calls_the_tool_and_answers_from_the_result(llm):
    tools = demo_tools.TOOLS
    messages = [{"role": "user", "content": demo_tools.DEMO_TOOL_QUESTION}]
    out, result = _chat(llm, messages, tools)
    assert out.finish_reason == "stop"
    assert result.reasoning and "Tokyo" in result.reasoning
    (call,) = result.tool_calls
    assert call["function"]["name"] == "get_weather"
    arguments = demo_tools.check_arguments("get_weather", call["function"]["arguments"])
    assert arguments == {"city": "Tokyo", "unit": "fahrenheit"}

    tool_result = demo_tools.run_tool("get_weather", arguments)
    messages += [{"role": "assistant", "content": None, "tool_calls": result.tool_calls},
                 {"role": "tool", "tool_call_id": call["id"], "content": tool_result}]
    _, final = _chat(llm, messages, tools)
    assert final.tool_calls == [] and final.reasoning
    facts = json.loads(tool_result)
    assert final.content is not None
    assert str(facts["temperature"]) in final.content and facts["condition"] in final.content


def test_engine_greedy_tokens_match_transformers(llm):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    reference = Qwen3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": demo_tools.DEMO_TOOL_QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, tools=demo_tools.TOOLS,
                                           add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=GREEDY.max_tokens,
                                      eos_token_id=reference.generation_config.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    out = llm.chat(messages, GREEDY, tools=demo_tools.TOOLS, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[0].tolist()
    assert out.outputs[0].token_ids == expected.tolist()


def test_schema_check_rejects_bad_arguments():
    check = demo_tools.check_arguments
    assert check("get_weather", '{"city": "Oslo", "unit": "celsius"}') == {"city": "Oslo",
                                                                          "unit": "celsius"}
    for bad in ('{"city": "Oslo", "unit": "kelvin"}', '{"city": 3, "unit": "celsius"}',
                '{"city": "Oslo"}', '{"city": "Oslo", "unit": "celsius", "days": 2}', "{"):
        with pytest.raises(ValueError):
            check("get_weather", bad)
    with pytest.raises(ValueError):
        check("search", '{"query": "x", "max_results": true}')
    with pytest.raises(ValueError):
        check("search", '{"query": "x", "max_results": 11}')
    with pytest.raises(ValueError):
        check("nope", "{}")


def test_cli_defaults_to_the_demo_model():
    from inference_engine.cli import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["generate", "--prompt", "Hello", "--max-tokens", "4",
                                      "--json", "--kv-cache-memory", str(16 << 20),
                                      "--platform", TEST_PLATFORM])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output.strip().splitlines()[-1])["token_ids"]) <= 4
