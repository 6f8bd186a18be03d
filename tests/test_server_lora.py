"""LoRA on the OpenAI server: --enable-lora / --lora-modules, adapters as model names,
/v1/load_lora_adapter and /v1/unload_lora_adapter behind the API key. The reference
for the generated text is transformers with the adapter applied by peft."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from inference_engine.lora.testing import ALL_TARGETS, make_peft_adapter, peft_reference
from inference_engine.testing import TEST_PLATFORM, ServerProcess, run_cli
from inference_engine.testing_parity import hf_greedy

pytest.importorskip("peft")

KEY = "lora-key"
PROMPT = "the quick brown fox"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory):
    base = tiny_model_dirs["qwen3"]
    root = tmp_path_factory.mktemp("server_lora")
    return {
        "first": make_peft_adapter(base, root / "first", seed=11, r=8, lora_alpha=16,
                                   target_modules=ALL_TARGETS),
        "second": make_peft_adapter(base, root / "second", seed=12, r=4, lora_alpha=4,
                                    use_rslora=True, target_modules=["q_proj", "down_proj"]),
        "rank16": make_peft_adapter(base, root / "rank16", seed=13, r=16, lora_alpha=16,
                                    target_modules=["v_proj"]),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dirs, adapters):
    proc = ServerProcess(tiny_model_dirs["qwen3"], "--served-model-name", "base",
                         "--api-key", KEY, "--enable-lora",
                         "--lora-modules", f"first={adapters['first']}",
                         "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                         platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def complete(server, model: str) -> httpx.Response:
    return post(server, "/v1/completions", {"model": model, "prompt": PROMPT, "temperature": 0,
                                            "max_tokens": NEW_TOKENS, "ignore_eos": True})


def expected_text(base, adapter) -> str:
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer.encode(PROMPT)
    out = hf_greedy(peft_reference(base, adapter), [ids], NEW_TOKENS)[0]
    return tokenizer.decode(out, skip_special_tokens=True)


def test_adapters_are_model_names(server, tiny_model_dirs, adapters) -> None:
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    cards = {m["id"]: m for m in models.json()["data"]}
    assert set(cards) == {"base", "first"}
    assert cards["first"]["parent"] == "base"
    assert cards["first"]["root"] == str(adapters["first"])
    base = tiny_model_dirs["qwen3"]
    first = complete(server, "first").json()
    assert first["model"] == "first"
    with_adapter = first["choices"][0]["text"]
    plain = complete(server, "base").json()["choices"][0]["text"]
    assert with_adapter == expected_text(base, adapters["first"])
    assert plain == expected_text(base, None)
    assert with_adapter != plain
    chat = post(server, "/v1/chat/completions", {
        "model": "first", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "first"


def test_load_and_unload_adapters(server, tiny_model_dirs, adapters) -> None:
    body = {"lora_name": "second", "lora_path": str(adapters["second"])}
    assert post(server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    loaded = post(server, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert "second" in loaded.text
    again = post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert complete(server, "second").json()["choices"][0]["text"] == expected_text(
        tiny_model_dirs["qwen3"], adapters["second"])

    bad = post(server, "/v1/load_lora_adapter",
               {"lora_name": "big", "lora_path": str(adapters["rank16"])})
    assert bad.status_code == 400
    assert "rank 16 is above max_lora_rank (8)" in bad.json()["error"]["message"]
    extra = post(server, "/v1/load_lora_adapter", {**body, "lora_name": "x", "base": 1})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "base"

    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "second"},
                key=None).status_code == 401
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
    gone = complete(server, "second")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 404
    # The start-up adapter still serves.
    assert complete(server, "first").status_code == 200


def test_lora_modules_need_enable_lora(tiny_model_dirs, adapters) -> None:
    result = run_cli("serve", str(tiny_model_dirs["qwen3"]), "--platform", TEST_PLATFORM,
                     "--kv-cache-memory", "16MiB", "--lora-modules", f"a={adapters['first']}")
    assert result.returncode == 2
    assert "--lora-modules needs --enable-lora" in result.stderr


def test_bad_startup_adapter_is_named(tiny_model_dirs, adapters) -> None:
    result = run_cli("serve", str(tiny_model_dirs["qwen3"]), "--platform", TEST_PLATFORM,
                     "--kv-cache-memory", "16MiB", "--enable-lora", "--max-lora-rank", "8",
                     "--lora-modules", f"big={adapters['rank16']}")
    assert result.returncode == 2
    assert "LoRA adapter 'big': rank 16 is above max_lora_rank (8)" in result.stderr
