"""Launch flags vLLM users reach for (issue 28, items 5-6): ``--config FILE.yaml``,
``--chat-template``, ``--tokenizer``, ``--generation-config``, ``/ping``, ``/load``,
``--vllm-metric-names``, ``--trust-remote-code`` and Hugging Face ids. Real server
processes; references are transformers' own tokenizer and template rendering."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from inference_engine.cli import app
from inference_engine.entrypoints.chat_template import load_chat_template
from inference_engine.testing import TEST_PLATFORM, ServerProcess

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def copy_model(src, dst, generation_config: dict | None = None, tokenizer: bool = True):
    """A copy of the tiny model folder, optionally without its tokenizer, with extra
    ``generation_config.json`` values."""
    shutil.copytree(src, dst)
    if not tokenizer:
        for name in TOKENIZER_FILES:
            (dst / name).unlink(missing_ok=True)
    if generation_config:
        file = dst / "generation_config.json"
        data = json.loads(file.read_text()) if file.exists() else {}
        file.write_text(json.dumps({**data, **generation_config}))
    return dst


KEY = "launch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def chat(server, name: str, **kwargs):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    return c.chat.completions.create(model=name, messages=MESSAGES, **kwargs)


# ---- --config FILE.yaml, --tokenizer, --chat-template FILE, --generation-config FOLDER ----
@pytest.fixture(scope="module")
def yaml_server(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_yaml")
    src = tiny_model_dirs["qwen3"]
    model = copy_model(src, root / "model", {"max_new_tokens": 7}, tokenizer=False)
    folder = root / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5,
                                                               "top_k": 1}))
    (root / "template.jinja").write_text(TEMPLATE)
    (root / "serve.yaml").write_text(
        f"served-model-name: from-yaml\n"
        f"port: 1\n"  # the command line's --port wins
        f"tokenizer: {src}\n"
        f"chat_template: {root / 'template.jinja'}\n"
        f"generation-config: {folder}\n"
        f"max-model-len: 128\n"
        f"vllm-metric-names: true\n")
    proc = ServerProcess(model, "--config", str(root / "serve.yaml"), platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_yaml_flags_apply_and_the_command_line_wins(yaml_server):
    models = httpx.get(yaml_server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["from-yaml"]
    assert models["data"][0]["max_model_len"] == 128


def test_tokenizer_and_chat_template_file_render_as_transformers_does(yaml_server,
                                                                      tiny_model_dirs):
    # The model folder has no tokenizer: --tokenizer supplies it.
    reference = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen3"])
    expected = reference.apply_chat_template(MESSAGES, chat_template=TEMPLATE,
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    got = httpx.post(yaml_server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert got["tokens"] == list(expected)
    text = httpx.post(yaml_server.url + "/tokenize", json={"prompt": "hello there"}).json()
    assert text["tokens"] == reference.encode("hello there")


def test_generation_config_folder_supplies_unset_sampling_fields(yaml_server):
    # max_new_tokens 5 from the folder (not the checkpoint's 7) caps an unset max_tokens.
    out = chat(yaml_server, "from-yaml", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    # top_k 1 from the folder makes any temperature greedy; a request's own value wins.
    greedy = chat(yaml_server, "from-yaml", temperature=0, max_tokens=5,
                  extra_body={"ignore_eos": True}).choices[0].message.content
    for seed in (1, 2, 3):
        hot = chat(yaml_server, "from-yaml", temperature=1.5, seed=seed, max_tokens=5,
                   extra_body={"ignore_eos": True}).choices[0].message.content
        assert hot == greedy
    free = {chat(yaml_server, "from-yaml", temperature=1.5, seed=seed, max_tokens=5,
                 extra_body={"ignore_eos": True, "top_k": 0}).choices[0].message.content
            for seed in (1, 2, 3)}
    assert free != {greedy}


# ---- --generation-config vllm, inline --chat-template --------------------------
@pytest.fixture(scope="module")
def vllm_defaults_server(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_vllm")
    model = copy_model(tiny_model_dirs["qwen3"], root / "model", {"max_new_tokens": 3})
    inline = TEMPLATE.replace("\n", "\\n")  # one shell line; escapes decoded as vLLM does
    proc = ServerProcess(model, "--generation-config", "vllm", "--chat-template", inline,
                         "--max-model-len", "48", "--served-model-name", "m", "--api-key", KEY,
                         platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_generation_config_vllm_ignores_the_checkpoints_defaults(vllm_defaults_server,
                                                                 tiny_model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen3"])
    prompt = tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE,
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    got = httpx.post(vllm_defaults_server.url + "/tokenize", json={"messages": MESSAGES},
                     headers=AUTH)
    assert got.json()["tokens"] == list(prompt)  # the inline template, newline decoded
    out = chat(vllm_defaults_server, "m", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 48 - len(prompt)  # the room left, not 3


# ---- /ping, /load and vLLM's metric names ----------------------------------------
def test_ping_answers_like_health_without_a_key(vllm_defaults_server):
    url = vllm_defaults_server.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/ping").status_code == 200
    assert httpx.post(url + "/ping").status_code == 200
    assert httpx.get(url + "/load").status_code == 401  # the rest stays behind the key


def test_load_counts_generation_requests_in_flight(vllm_defaults_server):
    url = vllm_defaults_server.url
    assert httpx.get(url + "/load", headers=AUTH).json() == {"server_load": 0}
    assert httpx.post(url + "/pause", headers=AUTH).status_code == 200
    results = []
    worker = threading.Thread(target=lambda: results.append(
        chat(vllm_defaults_server, "m", max_tokens=2)))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/load", headers=AUTH).json()["server_load"] != 1:
            assert time.monotonic() < deadline, "the paused request never showed in /load"
            time.sleep(0.05)
    finally:
        httpx.post(url + "/resume", headers=AUTH)
        worker.join(60)
    assert results and results[0].usage.completion_tokens <= 2
    assert httpx.get(url + "/load", headers=AUTH).json() == {"server_load": 0}


def samples(text: str, prefix: str) -> dict[str, float]:
    """``name{labels}`` -> value of the exposition's samples under ``prefix``."""
    return {line.rsplit(" ", 1)[0].removeprefix(prefix): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_vllm_metric_names_repeat_ours_with_the_same_values(yaml_server,
                                                            vllm_defaults_server):
    chat(yaml_server, "from-yaml", max_tokens=3)
    text = httpx.get(yaml_server.url + "/metrics").text
    ours, theirs = samples(text, "inference_engine:"), samples(text, "vllm:")
    names = {key.split("{")[0] for key in theirs}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_sum"):
        assert name in names, name
    for key, value in theirs.items():
        if "_created" not in key:  # creation times are read twice
            assert ours[key] == value, key
    assert theirs['generation_tokens_total{model_name="from-yaml"}'] >= 1
    assert "prefix_cache_hit_rate" not in names  # ours alone: vLLM has no such metric
    plain = httpx.get(vllm_defaults_server.url + "/metrics", headers=AUTH).text
    assert "inference_engine:prompt_tokens_total" in plain and "vllm:" not in plain


# ---- --trust-remote-code: a config class shipped in the model folder ---------------
CUSTOM_CONFIG = """from transformers import Qwen3Config


class TinyCustomConfig(Qwen3Config):
    model_type = "tiny_custom_qwen3"
"""


def test_trust_remote_code_runs_the_folders_config_class(tiny_model_dirs, tmp_path):
    from transformers import Qwen3ForCausalLM

    from inference_engine.entrypoints.llm import LLM
    from inference_engine.sampling_params import SamplingParams
    from inference_engine.testing_parity import hf_greedy

    src = tiny_model_dirs["qwen3"]
    model = copy_model(src, tmp_path / "custom")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "tiny_custom_qwen3"
    config["auto_map"] = {"AutoConfig": "configuration_tiny_custom.TinyCustomConfig"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_tiny_custom.py").write_text(CUSTOM_CONFIG)
    with pytest.raises(ValueError, match="--trust-remote-code"):
        LLM(str(model), show_progress=False, platform=TEST_PLATFORM, kv_cache_memory=1 << 22)
    result = CliRunner().invoke(app, ["serve", str(model), "--platform", TEST_PLATFORM])
    assert result.exit_code == 2 and "--trust-remote-code" in result.output

    llm = LLM(str(model), trust_remote_code=True, show_progress=False, platform=TEST_PLATFORM,
              kv_cache_memory=1 << 22)
    assert type(llm.engine.loaded.hf_config).__name__ == "TinyCustomConfig"
    prompt = AutoTokenizer.from_pretrained(src).encode("the quick brown fox")
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    reference = hf_greedy(Qwen3ForCausalLM.from_pretrained(src).eval(), [prompt], 8)[0]
    assert out[0].outputs[0].token_ids == reference


# ---- a Hugging Face model id, from an offline pre-populated Hub cache ----------------
HUB_ID = "tiny-org/tiny-qwen3"


def hub_cache(root, src):
    """The Hub cache layout (refs/main -> snapshots/<commit>/files) holding ``src``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


def test_hub_id_is_served_from_the_offline_cache(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["qwen3"]
    env = {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub", src)), "HF_HUB_OFFLINE": "1"}
    proc = ServerProcess(HUB_ID, "--api-key", KEY, env=env, platform=TEST_PLATFORM)
    try:
        models = httpx.get(proc.url + "/v1/models", headers=AUTH).json()["data"]
        assert [m["id"] for m in models] == [HUB_ID]  # named by its id, as vLLM
        got = httpx.post(proc.url + "/tokenize", json={"prompt": "hello there"},
                         headers=AUTH).json()
        assert got["tokens"] == AutoTokenizer.from_pretrained(src).encode("hello there")
    finally:
        assert proc.stop() == 0, proc.log()
    # An id the offline cache does not hold: exit 2 naming it, no network.
    result = subprocess.run(
        [sys.executable, "-m", "inference_engine.cli", "serve", "tiny-org/not-cached"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2, result.stderr
    assert "tiny-org/not-cached" in result.stderr and "HF_HUB_OFFLINE" in result.stderr


# ---- bad launch values exit 2 naming the flag, before any model loads ------------
def test_bad_launch_values_exit_2_naming_the_flag(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["qwen3"])
    runner = CliRunner()
    (tmp_path / "bad.yaml").write_text("max-num-seq: 4\n")
    (tmp_path / "list.yaml").write_text("- port\n")
    cases = [
        (["--config", str(tmp_path / "bad.yaml")], "max_num_seq"),
        (["--config", str(tmp_path / "list.yaml")], "mapping"),
        (["--config", str(tmp_path / "missing.yaml")], "--config"),
        (["--chat-template", str(tmp_path / "missing.jinja")], "--chat-template"),
        (["--generation-config", str(tmp_path / "nowhere")], "--generation-config"),
    ]
    for args, named in cases:
        result = runner.invoke(app, ["serve", model, *args])
        assert result.exit_code == 2, (args, result.output)
        assert named in result.output.replace("\n", "").replace("│", ""), (args, result.output)


def test_chat_template_reads_files_and_inline_text(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template("{{ x }}\\n") == "{{ x }}\n"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template("no/such/template.jinja")
