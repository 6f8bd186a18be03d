"""Launch flags vLLM users reach for (issue 28, items 5-6): ``--config FILE.yaml``,
``--chat-template``, ``--tokenizer``, ``--generation-config``, ``/ping``, ``/load``,
``--vllm-metric-names``, ``--trust-remote-code`` and Hugging Face ids. Real server
processes; references are transformers' own tokenizer and template rendering."""

from __future__ import annotations

import json
import shutil

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


def chat(server, name: str, **kwargs):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
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
        f"max-model-len: 128\n")
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
                         "--max-model-len", "48", "--served-model-name", "m",
                         platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_generation_config_vllm_ignores_the_checkpoints_defaults(vllm_defaults_server,
                                                                 tiny_model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen3"])
    prompt = tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE,
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    got = httpx.post(vllm_defaults_server.url + "/tokenize", json={"messages": MESSAGES})
    assert got.json()["tokens"] == list(prompt)  # the inline template, newline decoded
    out = chat(vllm_defaults_server, "m", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 48 - len(prompt)  # the room left, not 3


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
