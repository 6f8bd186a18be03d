"""A lone .gguf file is enough for LLM.chat and ``inference-engine serve``."""

from __future__ import annotations

import json
import urllib.request

import pytest
from gguf.constants import GGMLQuantizationType as T
from inference_engine import SamplingParams
from inference_engine.testing import TEST_PLATFORM, ServerProcess, cpu_llm
from inference_engine_gguf.export import export_to_gguf


@pytest.fixture(scope="module")
def lone_file(tmp_path_factory, tokenizer, make_hf_model):
    path = tmp_path_factory.mktemp("lone") / "model.gguf"
    export_to_gguf(make_hf_model("qwen3"), tokenizer, path, T.Q4_K)
    return path


def test_chat_uses_the_embedded_template(lone_file, tokenizer):
    llm = cpu_llm(str(lone_file), dtype="float32", show_progress=False, kv_cache_memory=1 << 22)
    messages = [{"role": "user", "content": "Say something about foxes."}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == tokenizer.encode(expected)
    assert len(out.outputs[0].token_ids) == 5
    assert llm.engine.eos_token_ids == {tokenizer.eos_token_id}


def test_serve_answers_chat_from_a_lone_file(lone_file):
    server = ServerProcess(lone_file, "--dtype", "float32", platform=TEST_PLATFORM)
    try:
        body = json.dumps({"model": str(lone_file), "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        request = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            reply = json.loads(r.read())
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        assert server.stop() == 0, server.log()[-3000:]
