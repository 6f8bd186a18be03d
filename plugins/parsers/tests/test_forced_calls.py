"""Forced tool calls in every parser's own format (``ToolParser.call_tag``).

The grammar that ``tool_choice`` "required"/named and ``strict`` tools compile to is
walked at random, token by token, with the demo model's tokenizer (every step picks
one of the tokens xgrammar allows). Whatever text comes out must be read back by the
same parser as calls of the right tools whose arguments satisfy the tools' JSON
schemas (checked with ``jsonschema``): the grammar and the parser agree on the format.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
from inference_engine.entrypoints.openai.errors import APIError
from inference_engine.entrypoints.openai.request_sampling import tool_call_constraint
from inference_engine_parsers.testing import factory

xgrammar = pytest.importorskip("xgrammar")
transformers = pytest.importorskip("transformers")

DEMO_MODEL = Path(__file__).resolve().parents[3] / "models" / "demo-qwen3-tiny"
FORMATS = ["qwen3", "qwen3_coder", "nemotron_v3", "minimax_m2", "glm45", "glm47",
           "deepseek_v31", "nemotron_v2"]
SAMPLES = 6
MAX_STEPS = 400


def _tool(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": {
        "type": "object", "properties": properties, "required": required,
        "additionalProperties": False}}}


# Bounded values so a random walk ends; every JSON type the XML formats must type back.
TOOLS = [
    _tool("get_weather", {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _tool("add", {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                  "b": {"type": "integer", "minimum": 0, "maximum": 9},
                  "exact": {"type": "boolean"}}, ["a", "b", "exact"]),
    _tool("plan", {"steps": {"type": "array", "maxItems": 2,
                             "items": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "note": {"type": ["string", "null"], "maxLength": 4}}, ["steps", "note"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def compiler():
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    return tokenizer, xgrammar.GrammarCompiler(info, cache_enabled=False)


def _walk(compiler, constraint, seed: int) -> str:
    """Text of one random path through the grammar (stops when it may end, half the time)."""
    tokenizer, grammar_compiler = compiler
    if constraint.structural_tag is not None:
        grammar = grammar_compiler.compile_structural_tag(json.dumps(constraint.structural_tag))
    else:  # formats whose whitespace is narrowed come as EBNF
        grammar = grammar_compiler.compile_grammar(constraint.grammar)
    matcher = xgrammar.GrammarMatcher(grammar)
    vocab = len(tokenizer)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        matcher.fill_next_token_bitmask(bitmask)
        bits = bitmask[0].numpy().astype("uint32")
        allowed = [i for i in range(vocab) if bits[i >> 5] >> (i & 31) & 1]
        if tokenizer.eos_token_id in allowed and (rng.random() < 0.5 or len(allowed) == 1):
            assert matcher.accept_token(tokenizer.eos_token_id)
            return tokenizer.decode(ids)
        token = rng.choice([i for i in allowed if i != tokenizer.eos_token_id])
        assert matcher.accept_token(token)
        ids.append(token)
    raise AssertionError(f"no end after {MAX_STEPS} tokens: {tokenizer.decode(ids)!r}")


def _read_back(fmt: str, text: str) -> list[tuple[str, dict]]:
    parsed = factory(fmt).parse(text, tools=TOOLS).simple()
    return [(c["name"], c["arguments"]) for c in parsed["tool_calls"]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_named_tool_choice_writes_one_call_the_parser_reads(compiler, fmt):
    parser_cls = factory(fmt).tool_parser_cls
    assert parser_cls.call_tag is not None
    for seed in range(SAMPLES):
        name = TOOLS[seed % len(TOOLS)]["function"]["name"]
        tag = tool_call_constraint(parser_cls, TOOLS, {"type": "function",
                                                       "function": {"name": name}}, None)
        text = _walk(compiler, tag, seed)
        calls = _read_back(fmt, text)
        assert [n for n, _ in calls] == [name], text
        jsonschema.validate(calls[0][1], SCHEMAS[name])


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_writes_calls_first_and_strict_arguments_follow_the_schema(compiler, fmt):
    parser_cls = factory(fmt).tool_parser_cls
    for seed in range(SAMPLES):
        tag = tool_call_constraint(parser_cls, TOOLS, "required", False)
        text = _walk(compiler, tag, 100 + seed)
        assert text.startswith(parser_cls.call_tag.trigger), text
        calls = _read_back(fmt, text)
        assert len(calls) == 1, text  # parallel_tool_calls false: the first call only
        name, arguments = calls[0]
        jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.parametrize("fmt", ["qwen3_coder", "minimax_m2", "glm45", "deepseek_v31"])
def test_a_name_the_format_cannot_write_is_a_400(fmt):
    bad = [_tool("get weather", {"city": {"type": "string"}}, ["city"])]
    with pytest.raises(APIError, match="tools\\[0\\].function.name"):
        tool_call_constraint(factory(fmt).tool_parser_cls, bad, "required", None)
