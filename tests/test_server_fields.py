"""Every request field of vLLM's and OpenAI's chat/completions APIs is either honoured
(each with a behavioural check here) or refused with a 400 that names it; and structured
outputs through the server with the official ``openai`` client: random JSON schemas,
streamed and not, every finished completion validates with ``jsonschema``."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from inference_engine.structured_output.random_schemas import random_schema
from inference_engine.testing import TEST_PLATFORM, ServerProcess, make_scripted_model
from transformers import AutoTokenizer

NAME = "tiny"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPT = "The quick brown fox"

# ---- the fields, as the two APIs document them ------------------------------------
OPENAI_CHAT = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
    "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options"]
OPENAI_COMPLETIONS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user"]
VLLM_SHARED = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
    "cache_salt", "kv_transfer_params", "vllm_xargs", "add_special_tokens"]
VLLM_CHAT = VLLM_SHARED + [
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs"]
VLLM_COMPLETIONS = VLLM_SHARED + ["prompt_embeds"]

# Refused: (endpoint, field, a value a client would send); the 400 must name the field.
REFUSED = [(path, field, value) for path, fields in (
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
            "functions": [{"name": "f"}], "metadata": {"k": "v"}, "modalities": ["text"],
            "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
            "reasoning_effort": "low", "safety_identifier": "u", "service_tier": "auto",
            "store": True, "verbosity": "low", "web_search_options": {}, "echo": True,
            "documents": [{"text": "d"}], "chat_template": "{{ messages }}",
            "mm_processor_kwargs": {}, "add_special_tokens": True}),
    (COMPLETIONS, {"suffix": "end", "best_of": 3, "prompt_embeds": "AAAA"}),
    (None, {"use_beam_search": True, "length_penalty": 0.5,
            "spaces_between_special_tokens": False, "guided_whitespace_pattern": " ",
            "priority": 1, "logits_processors": ["x"],
            "return_token_ids": True, "cache_salt": "s", "kv_transfer_params": {},
            "vllm_xargs": {"a": 1}}),
) for field, value in fields.items()]


def _refused_on(path):
    return {f for p, f, _ in REFUSED if p in (path, None)}


# ---- servers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    proc = ServerProcess(tiny_model_dirs["qwen3"], "--served-model-name", NAME,
                         "--max-num-seqs", "16", platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs):
    return AutoTokenizer.from_pretrained(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


TWO_CALLS = ["\n<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
             "\n</tool_call>", "\n<tool_call>",
             '\n{"name": "get_weather", "arguments": {"city": "Rome"}}', "\n</tool_call>\n"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("two_calls"), TWO_CALLS)
    proc = ServerProcess(model, "--enable-auto-tool-choice", platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


# ---- helpers ------------------------------------------------------------------------------
def body_for(path, **fields):
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    return {**base, "max_tokens": 12, "temperature": 0, **fields}


def post(http, path, **fields):
    r = http.post(path, json=body_for(path, **fields))
    assert r.status_code == 200, r.text
    return r.json()


def text_of(response, i=0):
    choice = response["choices"][i]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def ids_of(http, path, i=0, **fields):
    """Generated token ids, read from token-id logprobs."""
    lp = {"logprobs": True} if path == CHAT else {"logprobs": 0}
    response = post(http, path, return_tokens_as_token_ids=True, **lp, **fields)
    logprobs = response["choices"][i]["logprobs"]
    tokens = [t["token"] for t in logprobs["content"]] if path == CHAT else logprobs["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens], response


def chat_len(tok, messages, **kwargs):
    """Prompt tokens of a conversation as the tokenizer's template renders it."""
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return len(tok.encode(text, add_special_tokens=False))


def stream_chunks(http, path, **fields):
    chunks = []
    with http.stream("POST", path, json=body_for(path, stream=True, **fields)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ---- honoured fields: one behavioural check each -----------------------------------------
def check_model(http, path, tok):
    assert post(http, path, model=NAME)["model"] == NAME
    assert http.post(path, json=body_for(path, model="other")).status_code == 404


def check_prompt(http, path, tok):
    usage = post(http, path)["usage"]
    if path == COMPLETIONS:
        assert usage["prompt_tokens"] == len(tok.encode(PROMPT))
    else:
        assert usage["prompt_tokens"] == chat_len(tok, MESSAGES, add_generation_prompt=True)


def check_penalty(name):
    def check(http, path, tok):
        plain, _ = ids_of(http, path, max_tokens=24, ignore_eos=True)
        penalised, _ = ids_of(http, path, max_tokens=24, ignore_eos=True, **{name: 2.0})
        assert penalised != plain
        # The penalty's purpose: fewer repeated tokens than the unpenalised greedy output.
        assert len(set(penalised)) >= len(set(plain))
    return check


def check_logit_bias(http, path, tok):
    plain, _ = ids_of(http, path, ignore_eos=True)
    biased, _ = ids_of(http, path, ignore_eos=True,
                       logit_bias={str(t): -100 for t in set(plain)})
    assert not set(biased) & set(plain)


def check_logprobs(http, path, tok):
    ids, response = ids_of(http, path, ignore_eos=True)
    assert len(ids) == response["usage"]["completion_tokens"] == 12


def check_top_logprobs(http, path, tok):
    response = post(http, path, logprobs=True, top_logprobs=3)
    assert all(len(t["top_logprobs"]) == 3 for t in response["choices"][0]["logprobs"]["content"])
    everything = post(http, path, logprobs=True, top_logprobs=-1, max_tokens=1)
    assert len(everything["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == len(tok)


def check_max_tokens(name):
    def check(http, path, tok):
        assert post(http, path, ignore_eos=True, **{"max_tokens": None, name: 5}
                    )["usage"]["completion_tokens"] == 5
    return check


def check_n(http, path, tok):
    response = post(http, path, n=3, temperature=1.0, seed=1)
    assert sorted(c["index"] for c in response["choices"]) == [0, 1, 2]


def check_seed(http, path, tok):
    a = text_of(post(http, path, temperature=1.0, seed=5, ignore_eos=True))
    b = text_of(post(http, path, temperature=1.0, seed=5, ignore_eos=True))
    c = text_of(post(http, path, temperature=1.0, seed=6, ignore_eos=True))
    assert a == b != c


def check_temperature(http, path, tok):
    greedy = {text_of(post(http, path, temperature=0, ignore_eos=True)) for _ in range(2)}
    hot = {text_of(post(http, path, temperature=1.5, seed=s, ignore_eos=True)) for s in range(3)}
    assert len(greedy) == 1 and len(hot) > 1


def check_equals_greedy(**fields):
    def check(http, path, tok):
        greedy = text_of(post(http, path, ignore_eos=True))
        assert text_of(post(http, path, ignore_eos=True, temperature=1.0, seed=3,
                            **fields)) == greedy
    return check


def check_stop(http, path, tok):
    full = text_of(post(http, path, ignore_eos=True))
    stop = full[4:7]
    response = post(http, path, ignore_eos=True, stop=[stop])
    assert text_of(response) == full[:full.index(stop)]
    assert response["choices"][0]["finish_reason"] == "stop"


def check_include_stop_str(http, path, tok):
    full = text_of(post(http, path, ignore_eos=True))
    stop = full[4:7]
    out = text_of(post(http, path, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert out == full[:full.index(stop) + len(stop)]


def check_stop_token_ids(http, path, tok):
    ids, _ = ids_of(http, path, ignore_eos=True)
    response = post(http, path, ignore_eos=True, stop_token_ids=[ids[3]])
    assert response["choices"][0]["stop_reason"] == ids[3]
    assert response["usage"]["completion_tokens"] == ids.index(ids[3]) + 1


def check_ignore_eos(http, path, tok):
    eos = tok.eos_token_id
    # Forcing EOS first: without ignore_eos it ends at once, with it runs to max_tokens.
    bias = {"logit_bias": {str(eos): 100}}
    assert post(http, path, **bias)["usage"]["completion_tokens"] == 1
    assert post(http, path, ignore_eos=True, **bias)["usage"]["completion_tokens"] == 12


def check_min_tokens(http, path, tok):
    bias = {"logit_bias": {str(tok.eos_token_id): 100}}
    assert post(http, path, min_tokens=4, **bias)["usage"]["completion_tokens"] == 5


def check_skip_special_tokens(http, path, tok):
    special = tok.convert_tokens_to_ids("<|im_start|>")
    fields = {"allowed_token_ids": [special], "max_tokens": 2, "ignore_eos": True}
    assert text_of(post(http, path, **fields)) == ""
    assert text_of(post(http, path, skip_special_tokens=False, **fields)) == "<|im_start|>" * 2


def check_truncate(http, path, tok):
    assert post(http, path, truncate_prompt_tokens=3)["usage"]["prompt_tokens"] == 3


def check_prompt_logprobs(http, path, tok):
    response = post(http, path, prompt_logprobs=2)
    lists = response["choices"][0]["prompt_logprobs"] if path == COMPLETIONS \
        else response["prompt_logprobs"]
    assert lists[0] is None and len(lists) == response["usage"]["prompt_tokens"]
    assert all(2 <= len(p) <= 3 for p in lists[1:])
    assert http.post(path, json=body_for(path, prompt_logprobs=21)).status_code == 400


def check_allowed_token_ids(http, path, tok):
    allowed = list(range(40, 47))
    ids, _ = ids_of(http, path, temperature=1.0, seed=0, ignore_eos=True,
                    allowed_token_ids=allowed)
    assert set(ids) <= set(allowed)


def check_bad_words(http, path, tok):
    plain, _ = ids_of(http, path, ignore_eos=True, max_tokens=20)
    word = next(w for w in (tok.decode([t]).strip() for t in plain)
                if re.fullmatch("[A-Za-z]{2,}", w))
    banned = [tok.encode(p + word, add_special_tokens=False) for p in ("", " ")]
    ids, _ = ids_of(http, path, ignore_eos=True, max_tokens=20, bad_words=[word])
    assert ids != plain
    for seq in banned:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (word, seq)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def check_constraint(fields, valid):
    def check(http, path, tok):
        for seed in range(2):
            response = post(http, path, temperature=1.0, seed=seed, max_tokens=60, **fields)
            assert response["choices"][0]["finish_reason"] == "stop"
            assert valid(text_of(response)), text_of(response)
    return check


def _schema_valid(text):
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<a>"], "at_least_one": True, "stop_after_first": True,
    "tags": [{"type": "tag", "begin": "<a>", "end": "</a>",
              "content": {"type": "json_schema", "json_schema": SCHEMA}}]}}


def _tagged_valid(text):
    match = re.fullmatch("<a>(.*)</a>", text, re.S)
    return match is not None and _schema_valid(match.group(1))


def check_request_id(http, path, tok):
    r = http.post(path, json=body_for(path, request_id="mine-42"))
    assert r.json()["id"] == "mine-42" == r.headers["x-request-id"]


def check_return_tokens_as_token_ids(http, path, tok):
    ids, response = ids_of(http, path)
    assert tok.decode(ids, skip_special_tokens=True) == text_of(response)


def check_backend(http, path, tok):
    check_constraint({"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"},
                     lambda t: t in ("yes", "no"))(http, path, tok)
    r = http.post(path, json=body_for(path, guided_choice=["a"],
                                      guided_decoding_backend="outlines"))
    assert r.status_code == 400 and "guided_decoding_backend" in r.text


def check_stream(http, path, tok):
    whole = text_of(post(http, path))
    chunks = stream_chunks(http, path)
    key = "delta" if path == CHAT else None
    text = "".join((c["choices"][0][key].get("content") or "") if key
                   else c["choices"][0]["text"] for c in chunks if c["choices"])
    # At least a content chunk and the finish chunk: outputs a reader has not taken yet are
    # coalesced (server backpressure), so a loaded machine may deliver the text in one piece.
    assert text == whole and len(chunks) >= 2
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


def check_stream_options(http, path, tok):
    chunks = stream_chunks(http, path, ignore_eos=True,
                           stream_options={"include_usage": True})
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert all("usage" not in c for c in chunks[:-1])
    # Each chunk's usage counts the tokens sent so far (one logprob entry per token; a slow
    # reader may get several tokens in one chunk, so the number of chunks is not fixed).
    top = {"logprobs": 0} if path == COMPLETIONS else {"logprobs": True, "top_logprobs": 0}
    chunks = stream_chunks(http, path, ignore_eos=True, **top, stream_options={
        "include_usage": True, "continuous_usage_stats": True})
    sent, counts = 0, []
    for chunk in chunks:
        if not chunk["choices"]:
            continue
        logprobs = chunk["choices"][0].get("logprobs") or {}
        sent += len(logprobs.get("tokens") or logprobs.get("content") or ())
        if not chunk.get("usage"):  # (chat's first chunk: the role alone)
            continue
        counts.append(chunk["usage"]["completion_tokens"])
        assert counts[-1] == sent
    assert counts and counts[-1] == 12


def check_user(http, path, tok):
    # An end-user id for the operator's records: it must not change the output.
    assert text_of(post(http, path, user="u-1")) == text_of(post(http, path))


def check_echo(http, path, tok):
    assert text_of(post(http, path, echo=True)).startswith(PROMPT)


def check_best_of(http, path, tok):
    assert len(post(http, path, n=2, best_of=2, temperature=1.0, seed=0)["choices"]) == 2


def check_add_special_tokens(http, path, tok):
    for flag in (True, False):
        usage = post(http, path, add_special_tokens=flag)["usage"]
        assert usage["prompt_tokens"] == len(tok(PROMPT, add_special_tokens=flag)["input_ids"])


def check_add_generation_prompt(http, path, tok):
    with_prompt = post(http, path)["usage"]["prompt_tokens"]
    without = post(http, path, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert without == chat_len(tok, MESSAGES, add_generation_prompt=False) < with_prompt


def check_continue_final_message(http, path, tok):
    messages = MESSAGES + [{"role": "assistant", "content": "It is"}]
    usage = post(http, path, messages=messages, add_generation_prompt=False,
                 continue_final_message=True)["usage"]
    assert usage["prompt_tokens"] == chat_len(tok, messages, continue_final_message=True)


def check_chat_template_kwargs(http, path, tok):
    r = http.post(path, json=body_for(path, chat_template_kwargs={"tokenize": True}))
    assert r.status_code == 400 and "chat_template_kwargs" in r.text
    assert post(http, path, chat_template_kwargs={"enable_thinking": False})["choices"]


HONOURED_CHECKS = {
    "model": check_model, "prompt": check_prompt, "messages": check_prompt,
    "frequency_penalty": check_penalty("frequency_penalty"),
    "presence_penalty": check_penalty("presence_penalty"),
    "repetition_penalty": check_penalty("repetition_penalty"),
    "logit_bias": check_logit_bias, "logprobs": check_logprobs,
    "top_logprobs": check_top_logprobs, "max_tokens": check_max_tokens("max_tokens"),
    "max_completion_tokens": check_max_tokens("max_completion_tokens"), "n": check_n,
    "seed": check_seed, "temperature": check_temperature,
    "top_p": check_equals_greedy(top_p=1e-6), "top_k": check_equals_greedy(top_k=1),
    "min_p": check_equals_greedy(min_p=1.0), "stop": check_stop,
    "include_stop_str_in_output": check_include_stop_str,
    "stop_token_ids": check_stop_token_ids, "ignore_eos": check_ignore_eos,
    "min_tokens": check_min_tokens, "skip_special_tokens": check_skip_special_tokens,
    "truncate_prompt_tokens": check_truncate, "prompt_logprobs": check_prompt_logprobs,
    "allowed_token_ids": check_allowed_token_ids, "bad_words": check_bad_words,
    "response_format": check_constraint(
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "n", "schema": SCHEMA}}}, _schema_valid),
    "structured_outputs": check_constraint({"structured_outputs": {"regex": "[a-c]{2}"}},
                                           lambda t: re.fullmatch("[a-c]{2}", t)),
    "guided_json": check_constraint({"guided_json": SCHEMA}, _schema_valid),
    "guided_regex": check_constraint({"guided_regex": r"\d{3}"},
                                     lambda t: re.fullmatch(r"\d{3}", t)),
    "guided_choice": check_constraint({"guided_choice": ["red", "blue"]},
                                      lambda t: t in ("red", "blue")),
    "guided_grammar": check_constraint({"guided_grammar": 'root ::= "x" [0-9]'},
                                       lambda t: re.fullmatch("x[0-9]", t)),
    "structural_tag": check_constraint({"structural_tag": json.dumps(TAG)}, _tagged_valid),
    "guided_decoding_backend": check_backend, "request_id": check_request_id,
    "return_tokens_as_token_ids": check_return_tokens_as_token_ids,
    "stream": check_stream, "stream_options": check_stream_options, "user": check_user,
    "echo": check_echo, "best_of": check_best_of, "add_special_tokens": check_add_special_tokens,
    "add_generation_prompt": check_add_generation_prompt,
    "continue_final_message": check_continue_final_message,
    "chat_template_kwargs": check_chat_template_kwargs,
}
# Honoured, checked with the tool-calling server below.
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}

CASES = [(path, field) for path, fields in ((CHAT, OPENAI_CHAT + VLLM_CHAT),
                                            (COMPLETIONS, OPENAI_COMPLETIONS + VLLM_COMPLETIONS))
         for field in dict.fromkeys(fields) if field not in _refused_on(path)
         and field not in TOOL_FIELDS]


def test_every_field_is_listed_as_honoured_or_refused():
    for path, fields in ((CHAT, OPENAI_CHAT + VLLM_CHAT),
                         (COMPLETIONS, OPENAI_COMPLETIONS + VLLM_COMPLETIONS)):
        unplaced = [f for f in fields if f not in _refused_on(path)
                    and f not in HONOURED_CHECKS and f not in TOOL_FIELDS]
        assert not unplaced, (path, unplaced)


@pytest.mark.parametrize(("path", "field"), CASES, ids=[f"{p[4:]}-{f}" for p, f in CASES])
def test_honoured_field(http, tokenizer, path, field):
    HONOURED_CHECKS[field](http, path, tokenizer)


REFUSED_CASES = [(path, field, value) for p, field, value in REFUSED
                 for path in ((CHAT, COMPLETIONS) if p is None else (p,))]


@pytest.mark.parametrize(("path", "field", "value"), REFUSED_CASES,
                         ids=[f"{p[4:]}-{f}" for p, f, _ in REFUSED_CASES])
def test_refused_field_is_a_400_naming_it(http, path, field, value):
    r = http.post(path, json=body_for(path, **{field: value}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and error["param"] == field, error


def test_tool_fields(tool_server):
    with httpx.Client(base_url=tool_server.url, timeout=120) as http:
        def calls(**fields):
            r = http.post(CHAT, json={"messages": MESSAGES, "temperature": 0, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"].get("tool_calls") or []
        both = calls(tools=TOOLS)
        assert [json.loads(c["function"]["arguments"])["city"] for c in both] == ["Paris", "Rome"]
        first_only = calls(tools=TOOLS, parallel_tool_calls=False)
        assert [c["function"] for c in first_only] == [both[0]["function"]]
        assert calls(tools=TOOLS, tool_choice="none") == []
        chunks = []
        body = {"messages": MESSAGES, "temperature": 0, "tools": TOOLS, "stream": True,
                "parallel_tool_calls": False}
        with http.stream("POST", CHAT, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        indexes = {c["index"] for chunk in chunks for choice in chunk["choices"]
                   for c in choice["delta"].get("tool_calls") or ()}
        assert indexes == {0}


# ---- structured outputs with the official client: random schemas ------------------------
def test_random_schemas_through_the_openai_client(client):
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(24)]
    stopped = 0
    for i, schema in enumerate(schemas):
        kwargs = dict(model=NAME, messages=MESSAGES, temperature=1.0, seed=i, max_tokens=300,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": f"s{i}", "schema": schema,
                                                       "strict": True}})
        if i % 2:
            text, finish = "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        if finish == "length":
            continue  # a random model may write whitespace until max_tokens
        stopped += 1
        jsonschema.validate(json.loads(text), schema)
    assert stopped >= len(schemas) - 2


def test_completions_json_object_and_two_spellings(client, http):
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=200, temperature=0.7,
                                    seed=1, extra_body={"response_format": {
                                        "type": "json_object"}, "structured_outputs": None})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    r = http.post(COMPLETIONS, json=body_for(COMPLETIONS, guided_regex="a",
                                             guided_choice=["b"]))
    assert r.status_code == 400 and "guided_choice" in r.json()["error"]["message"]
    r = http.post(COMPLETIONS, json=body_for(COMPLETIONS, guided_regex="(unclosed"))
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]


# ---- forced and strict tool calls, in the demo model's own format -----------------------
DEMO_MODEL = Path(__file__).resolve().parents[1] / "models" / "demo-qwen3-tiny"
def _strict(name, properties, required):
    return {"type": "function", "function": {
        "name": name, "strict": True, "parameters": {
            "type": "object", "properties": properties, "required": required,
            "additionalProperties": False}}}


# The demo's tools (scripts/demo_tools.py), strict, strings bounded.
STRICT_TOOLS = [
    _strict("get_weather", {"city": {"type": "string", "maxLength": 16},
                            "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _strict("add", {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                    "b": {"type": "integer", "minimum": -999, "maximum": 999}}, ["a", "b"]),
    _strict("get_time", {"timezone": {"type": "string", "maxLength": 24}}, ["timezone"]),
    _strict("search", {"query": {"type": "string", "maxLength": 24},
                       "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
            ["query", "max_results"])]
QUESTIONS = ["What is the weather like in Tokyo in fahrenheit?",
             "What is the weather like in Paris in celsius?", "What is 2 plus 3?",
             "What time is it in Europe/Paris?", "Search the web for llamas"]


@pytest.fixture(scope="module")
def demo_client():
    proc = ServerProcess(DEMO_MODEL, "--enable-auto-tool-choice", platform=TEST_PLATFORM)
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    assert proc.stop() == 0, proc.log()


def _calls(demo_client, stream, **kwargs):
    """(tool calls as (name, arguments object), finish_reason) of one chat request."""
    model = demo_client.models.list().data[0].id
    if not stream:
        choice = demo_client.chat.completions.create(model=model, **kwargs).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls or ()]
        return calls, choice.finish_reason
    parts, finish = {}, None
    for chunk in demo_client.chat.completions.create(model=model, stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                name, args = parts.get(call.index, ("", ""))
                parts[call.index] = (name + (call.function.name or ""),
                                     args + (call.function.arguments or ""))
    return [(n, json.loads(a)) for _, (n, a) in sorted(parts.items())], finish


def _check_calls(calls, names=None):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in STRICT_TOOLS}
    for name, arguments in calls:
        assert names is None or name in names
        jsonschema.validate(arguments, schemas[name])


@pytest.mark.parametrize("stream", [False, True])
def test_strict_tools_arguments_follow_their_schema(demo_client, stream):
    made = 0
    for seed, question in enumerate(QUESTIONS):
        calls, finish = _calls(demo_client, stream, messages=[
            {"role": "user", "content": question}], tools=STRICT_TOOLS, temperature=0.8,
            seed=seed, max_tokens=300)
        if finish == "length":
            continue
        _check_calls(calls)
        made += len(calls)
    assert made >= 3  # the demo model was trained to call these tools


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_are_forced(demo_client, stream):
    for seed in range(2):
        messages = [{"role": "user", "content": "Hello!"}]  # a question needing no tool
        calls, finish = _calls(demo_client, stream, messages=messages, tools=STRICT_TOOLS,
                               tool_choice="required", temperature=0.8, seed=seed,
                               max_tokens=300)
        assert finish == "tool_calls" and calls
        _check_calls(calls)
        named = {"type": "function", "function": {"name": "search"}}
        calls, finish = _calls(demo_client, stream, messages=messages, tools=STRICT_TOOLS,
                               tool_choice=named, temperature=0.8, seed=seed, max_tokens=300)
        assert finish == "tool_calls" and len(calls) == 1
        _check_calls(calls, names={"search"})


@pytest.fixture(scope="module")
def coder_server():
    """The demo model served with the qwen3_coder tool parser and request templates on."""
    proc = ServerProcess(DEMO_MODEL, "--enable-auto-tool-choice", "--tool-call-parser",
                         "qwen3_coder", "--trust-request-chat-template", platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_forced_calls_in_an_xml_format_through_the_engine(coder_server):
    """The demo model writes qwen3 JSON calls; served with the qwen3_coder parser, a forced
    call must come out in qwen3_coder's XML (the grammar narrowed to its newlines) and be
    read back with arguments that follow the strict schemas."""
    client = openai.OpenAI(base_url=coder_server.url + "/v1", api_key="unused", max_retries=0)
    for seed, stream in [(0, False), (1, True)]:
        named = {"type": "function", "function": {"name": "add"}}
        calls, finish = _calls(client, stream, messages=[
            {"role": "user", "content": "What is 2 plus 3?"}], tools=STRICT_TOOLS,
            tool_choice=named, temperature=0.8, seed=seed, max_tokens=200)
        assert finish == "tool_calls" and len(calls) == 1
        _check_calls(calls, names={"add"})


def test_request_chat_template_is_rendered_when_trusted(coder_server):
    """With --trust-request-chat-template the request's own template renders the prompt
    (checked against the tokenizer on the same text); without it (the other servers of
    this module) the field is a 400 naming it (REFUSED)."""
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    expected = tok.encode("<<Hello there>>", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hello there"}]
    http = httpx.Client(base_url=coder_server.url, timeout=60)
    r = http.post("/tokenize", json={"messages": messages, "chat_template": template})
    assert r.status_code == 200 and r.json()["tokens"] == expected
    r = http.post(CHAT, json={"model": http.get("/v1/models").json()["data"][0]["id"],
                              "messages": messages, "chat_template": template,
                              "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)
    r = http.post(CHAT, json={"messages": messages, "chat_template": "{% for %}",
                              "max_tokens": 1})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_strict_tools_need_a_format_that_can_be_forced():
    from inference_engine.entrypoints.openai.errors import APIError
    from inference_engine.entrypoints.openai.request_sampling import tool_call_constraint
    from inference_engine_parsers.qwen3 import Qwen3ToolParser

    class UnforceableToolParser(Qwen3ToolParser):  # a third-party format without a call_tag
        call_tag = None

    with pytest.raises(APIError, match="strict"):
        tool_call_constraint(UnforceableToolParser, STRICT_TOOLS, "auto", None)
    assert tool_call_constraint(UnforceableToolParser, TOOLS, "required", None) is None


WEATHER = {"type": "object", "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "celsius": {"type": "integer", "minimum": -40, "maximum": 50}},
           "required": ["city", "celsius"]}


@pytest.mark.parametrize("thinking", [None, False])
def test_json_schema_applies_after_the_reasoning_section(demo_client, thinking):
    """Reasoning is free text (the qwen3 reasoning parser splits it off); the content is the
    JSON the schema asks for."""
    model = demo_client.models.list().data[0].id
    extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
    reasoned = 0
    for seed in range(3):
        message = demo_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0.7,
            seed=seed, max_tokens=400, extra_body=extra, response_format={
                "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        ).choices[0].message
        jsonschema.validate(json.loads(message.content), WEATHER)
        reasoned += bool(message.model_extra.get("reasoning_content"))
    assert reasoned == (3 if thinking is None else 0)
