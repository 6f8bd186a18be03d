"""The server runs a tiny Nemotron-H (Mamba-2 / attention / MoE / MLP hybrid) with the
Nemotron 3 parsers (``--tool-call-parser nemotron_v3 --reasoning-parser nemotron_v3``).

The checkpoint is a real ``NemotronHForCausalLM`` whose greedy output after a chat
prompt is a known Nemotron 3 script (reasoning, then a qwen3_coder-style XML call):
as in ``make_scripted_model``, each piece of the script is one added token and the
LM head maps each token to its successor, while every mixer keeps small random
weights (so the Mamba state, attention and experts all run and perturb the stream).
transformers' own greedy continuation is checked to be the script first, so the
server's message is compared with what the reference model says.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
import transformers
from inference_engine.testing import TEST_PLATFORM, ServerProcess, train_tiny_tokenizer
from inference_engine.testing_parity import randomize

SCRIPT = ["<think>", "Let me", " check the weather.", "</think>", "\n\n", "Sure.",
          "\n<tool_call>\n<function=get_weather>\n", "<parameter=city>\n", "Paris",
          "\n</parameter>\n", "</function>\n</tool_call>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HIDDEN = 128


def scripted_nemotron_h(path: Path) -> tuple[Path, list[int], list[int]]:
    """Save the scripted model; returns (folder, chat prompt ids, script ids)."""
    tokenizer = train_tiny_tokenizer()
    tokenizer.add_tokens(list(SCRIPT))
    piece_ids = [tokenizer.convert_tokens_to_ids(p) for p in SCRIPT]
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS,
                                               add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    chain = [prompt_ids[-1], *piece_ids, tokenizer.eos_token_id]
    config = transformers.NemotronHConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN,
        layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = randomize(transformers.AutoModelForCausalLM.from_config(config), std=0.02)
    with torch.no_grad():
        embed = torch.randn(len(tokenizer), HIDDEN)
        embed *= HIDDEN ** 0.5 / embed.norm(dim=1, keepdim=True)  # RMS 1 per row
        model.model.embeddings.weight.copy_(embed)
        model.model.norm_f.weight.fill_(1.0)
        head = torch.zeros(len(tokenizer), HIDDEN)
        for prev, nxt in zip(chain, chain[1:], strict=False):
            head[nxt] += 40.0 * embed[prev] / HIDDEN
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=len(SCRIPT) + 1,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    reference = out[0, len(prompt_ids):].tolist()
    assert reference == [*piece_ids, tokenizer.eos_token_id], "transformers must follow the script"
    return path, prompt_ids, piece_ids


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _, _ = scripted_nemotron_h(tmp_path_factory.mktemp("nemotron_h_scripted"))
    proc = ServerProcess(path, "--enable-auto-tool-choice", "--tool-call-parser", "nemotron_v3",
                         "--reasoning-parser", "nemotron_v3", "--dtype", "float32",
                         platform=TEST_PLATFORM)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_start_up_line_reports_the_kv_and_state_caches(server):
    assert "state cache:" in server.log() and "KV cache:" in server.log()


def test_reasoning_and_tool_call_of_a_hybrid_model(client):
    out = client.chat.completions.create(model=client.models.list().data[0].id,
                                         messages=MESSAGES, tools=TOOLS, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.model_extra["reasoning_content"].strip() == "Let me check the weather."
    assert (message.content or "").strip() == "Sure."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_deltas_add_up_to_the_same_message(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                            temperature=0, stream=True)
    reasoning, content, args, names, finish = "", "", "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.function.name:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning.strip() == "Let me check the weather." and content.strip() == "Sure."
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"}
