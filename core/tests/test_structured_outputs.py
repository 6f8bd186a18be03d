"""Structured outputs through the engine: every constrained sample obeys its constraint
(checked with jsonschema / re / the choice list), greedy constrained decoding equals a
transformers greedy loop masked by xgrammar's own matcher, and n > 1, preemption and async
scheduling change nothing."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
import xgrammar
from inference_engine import SamplingParams
from inference_engine.sampling.processors import apply_token_bitmask_
from inference_engine.sampling_params import StructuredOutputsParams
from inference_engine.structured_output.compiler import json_schema_ebnf
from inference_engine.structured_output.random_schemas import random_schema
from inference_engine.testing import cpu_llm, make_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["hello", "The quick brown fox", "a b c", "Paged attention"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def llm(model_path):
    return cpu_llm(model_path, dtype="float32", async_scheduling=False)


def _json(schema, compact=False):
    return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)


def _texts(outputs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def test_bitmask_matches_xgrammars_own_kernel():
    torch.manual_seed(0)
    for vocab in (31, 64, 100, 385):
        logits = torch.randn(5, vocab)
        bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32)
        expected = logits.clone()
        xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
        assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask), expected)


def test_random_schemas_validate(llm):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(16)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=300,
                             structured_outputs=_json(s, compact=i % 2 == 0))
              for i, s in enumerate(schemas)]
    outputs = llm.generate(["hello"] * len(schemas), params)
    stopped = 0
    for schema, output in zip(schemas, outputs, strict=True):
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            continue  # a random model may write whitespace until max_tokens
        stopped += 1
        jsonschema.validate(json.loads(completion.text), schema)
    assert stopped >= len(schemas) - 2


def test_n_samples_each_follow_the_schema_and_differ(llm):
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=200,
                            structured_outputs=_json(SCHEMA, compact=True))
    (output,) = llm.generate(["hello"], params)
    texts = [c.text for c in output.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1


def test_regex_choice_grammar_json_object(llm):
    kinds = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
             StructuredOutputsParams(choice=["yes", "no way", 'say "hi"']),
             StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")" | "x"'),
             StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=200, structured_outputs=k)
              for i, k in enumerate(kinds) for _ in range(3)]
    outputs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params)
    texts = [o.outputs[0].text for o in outputs]
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in texts[0:3]), texts[0:3]
    assert all(t in ("yes", "no way", 'say "hi"') for t in texts[3:6]), texts[3:6]
    assert all(re.fullmatch(r"\([a-c]+\)|x", t) for t in texts[6:9]), texts[6:9]
    for output in outputs[9:12]:
        if output.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(output.outputs[0].text), dict)


def test_greedy_equals_transformers_loop_masked_by_xgrammar(model_path, llm):
    """Reference: transformers' logits, xgrammar's matcher and its own bitmask kernel."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(json_schema_ebnf(SCHEMA, False))
    for prompt in PROMPTS[:2]:
        matcher = xgrammar.GrammarMatcher(compiled)
        ids = tokenizer.encode(prompt)
        bitmask = xgrammar.allocate_token_bitmask(1, model.config.vocab_size)
        expected = []
        for _ in range(60):
            with torch.no_grad():
                logits = model(torch.tensor([ids + expected])).logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            expected.append(token)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
        (output,) = llm.generate([prompt], SamplingParams(
            temperature=0, max_tokens=60, structured_outputs=_json(SCHEMA, compact=True)))
        assert output.outputs[0].token_ids == expected


def test_preemption_and_async_scheduling_change_nothing(model_path, llm):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=80, ignore_eos=i == 1,
                             structured_outputs=_json(SCHEMA, compact=True)) for i in range(4)]
    params.append(SamplingParams(temperature=0.8, seed=9, max_tokens=30))  # unconstrained
    prompts = PROMPTS + ["one"]
    expected = _texts(llm.generate(prompts, params))
    probe = cpu_llm(model_path, dtype="float32", block_size=4, kv_cache_memory=1 << 20)
    pool = probe.engine.runner.pool.bytes_per_block * 28
    small = cpu_llm(model_path, dtype="float32", block_size=4, kv_cache_memory=pool,
                    max_num_batched_tokens=16, async_scheduling=True)
    assert _texts(small.generate(prompts, params)) == expected
    assert small.engine.scheduler.num_preemptions > 0


def test_schema_compiled_once_and_bad_schema_fails_by_name(llm):
    engine = llm.engine
    llm.generate(["a", "b"], SamplingParams(max_tokens=5, n=2, structured_outputs=_json(SCHEMA)))
    pool = engine.structured.pool
    keys = [k for k in pool._cache if k[0] == "json"]
    llm.generate(["c"], SamplingParams(max_tokens=5, structured_outputs=_json(dict(SCHEMA))))
    assert [k for k in pool._cache if k[0] == "json"] == keys
    (output,) = llm.generate(["a"], SamplingParams(
        max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert output.finished and output.error and "structured_outputs.regex" in output.error
    assert not engine.has_unfinished_requests()


def test_structured_outputs_params_refuse_bad_values():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs.choice == ["a", "b"]


def test_abort_while_the_grammar_compiles_finishes_the_request(llm):
    engine = llm.engine
    rid = engine.add_request("hello", SamplingParams(max_tokens=5, n=2, structured_outputs=_json(
        {"type": "object", "properties": {"fresh": {"type": "integer"}}})))
    (output,) = engine.abort_request(rid)  # admission happens in step(): still compiling
    assert output.finished and {c.finish_reason for c in output.outputs} == {"abort"}
    assert not engine.has_unfinished_requests() and not engine.structured.num_waiting


def test_compile_cache_keeps_the_most_recent(model_path):
    from inference_engine.structured_output import GrammarCompilerPool

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pool = GrammarCompilerPool(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_cached=2)
    first = pool.submit(StructuredOutputsParams(regex="a"))
    pool.submit(StructuredOutputsParams(regex="b"))
    assert pool.submit(StructuredOutputsParams(regex="a")) is first  # a hit, now most recent
    pool.submit(StructuredOutputsParams(regex="c"))  # drops "b"
    assert [k[1] for k in pool._cache] == ["a", "c"]
    assert pool.compile(StructuredOutputsParams(regex="b")).grammar is not None
    pool.close()


# ---- reasoning models in the Python API (LLM(reasoning_parser=...)) ---------------------
DEMO_MODEL = __import__("pathlib").Path(__file__).resolve().parents[2] / "models" / \
    "demo-qwen3-tiny"
WEATHER = {"type": "object", "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "celsius": {"type": "integer", "minimum": -40, "maximum": 50}},
           "required": ["city", "celsius"]}


def test_llm_reasoning_parser_starts_the_constraint_after_the_reasoning():
    """The demo model reasons before answering. With ``reasoning_parser`` the schema holds
    for the content after ``</think>`` (split off by the same parser) while the reasoning
    stays free; with thinking switched off, or without a parser, it holds from the first
    token."""
    from inference_engine.parsing import PipelineFactory
    from inference_engine.registry import UnknownNameError

    with pytest.raises(UnknownNameError):
        cpu_llm(DEMO_MODEL, reasoning_parser="no_such_parser")
    llm = cpu_llm(DEMO_MODEL, reasoning_parser="qwen3", async_scheduling=False)
    conversation = [{"role": "user", "content": "What is the weather like in Tokyo?"}]
    # Compact JSON, so a constrained answer is short; samples cut by max_tokens (a long
    # reasoning section) are not judged, but most must finish.
    params = [SamplingParams(temperature=0.7, seed=seed, max_tokens=600,
                             structured_outputs=_json(WEATHER, compact=True))
              for seed in range(3)]
    parser = PipelineFactory(None, "qwen3")
    for thinking in (None, False):
        kwargs = None if thinking is None else {"enable_thinking": thinking}
        outputs = llm.chat([conversation] * 3, params, chat_template_kwargs=kwargs)
        finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason != "length"]
        assert len(finished) >= 2, [o.outputs[0].text for o in outputs]
        reasoned = 0
        for output in finished:
            result = parser.parse(output.text, enable_thinking=thinking).simple()
            jsonschema.validate(json.loads(result["content"]), WEATHER)
            reasoned += bool(result["reasoning"])
        # The reasoning section stays free (the model may close it at once); off, none.
        assert reasoned >= 1 if thinking is None else reasoned == 0
    plain = cpu_llm(DEMO_MODEL, async_scheduling=False)
    text = plain.chat([conversation], params[:1])[0].outputs[0].text
    jsonschema.validate(json.loads(text), WEATHER)  # no parser: JSON from the first token
