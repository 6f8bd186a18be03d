"""Train the embedded demo model: a tiny Qwen3 that thinks and calls tools.

Everything is made here, offline and seeded: a synthetic corpus of Qwen3-format
chats (questions, ``<think>`` reasoning, plain answers, ``<tool_call>`` calls to
the tools in ``demo_tools.py`` with typed arguments, tool results and final
answers), a byte-level BPE tokenizer with Qwen3's chat special tokens and a
Qwen3-style chat template, and a small ``Qwen3ForCausalLM`` trained with plain
PyTorch (AdamW, fp32, loss on assistant tokens only). The result is saved in
Hugging Face layout (default ``models/demo-qwen3-tiny/``), then checked: greedy
decoding on the fixed demo prompts must think, call the tool with arguments
that satisfy its schema, and answer from the tool result.

The committed model is two runs (docs/demo.md has the figures; ~36 min on 2 busy cores):

    .venv/bin/python scripts/train_demo_model.py --out /tmp/demo-stage1
    .venv/bin/python scripts/train_demo_model.py --init-from /tmp/demo-stage1 --seed 1 \\
        --steps 600 --lr 1e-3 --num-examples 8000
    .venv/bin/python scripts/train_demo_model.py --check    # only re-check a saved model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_tools  # noqa: E402  (the sibling module; scripts/ is not a package)
from demo_tools import CITIES, TOOLS  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "demo-qwen3-tiny"

# Special tokens (skipped when decoding) and the added tags the parsers read (kept).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
              "</tool_response>"]

# Qwen3's chat template, trimmed: tools in a system block, assistant tool calls
# as <tool_call> JSON, tool results grouped in a user turn as <tool_response>,
# reasoning kept only for assistant turns after the last user question, and
# enable_thinking=false pre-filling an empty think block.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\n\
For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n\
<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n\
</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = message.reasoning_content \
if message.reasoning_content is string else '' %}
        {%- if not reasoning_content and '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')\
.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content.lstrip('\\n') }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content.strip()) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


# --------------------------------------------------------------------------- corpus

COUNTRIES = {
    "France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Italy": "Rome",
    "Norway": "Oslo", "Austria": "Vienna", "Portugal": "Lisbon", "Greece": "Athens",
    "Russia": "Moscow", "Egypt": "Cairo", "Kenya": "Nairobi", "Japan": "Tokyo",
    "South Korea": "Seoul", "China": "Beijing", "Thailand": "Bangkok", "India": "New Delhi",
    "Australia": "Canberra", "Canada": "Ottawa", "Mexico": "Mexico City", "Peru": "Lima",
    "Argentina": "Buenos Aires", "Brazil": "Brasilia", "Poland": "Warsaw",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Ireland": "Dublin",
    "the United Kingdom": "London", "the United States": "Washington",
}
TOPICS = [
    "quantum computing", "the Eiffel Tower", "paged attention", "Python generators",
    "black holes", "the Roman Empire", "sourdough bread", "electric cars", "jazz music",
    "the Moon landing", "coral reefs", "machine learning", "the Great Wall", "chess openings",
    "solar panels", "honey bees", "volcanoes", "the Olympic Games", "climate change",
    "Mount Everest", "the printing press", "deep sea fish", "renewable energy",
    "origami", "the Nile river", "ancient Egypt", "tea ceremonies", "rust programming",
]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant.",
                  "Answer briefly and accurately."]
SELF_DESCRIPTION = ("I am a tiny demo model for inference-engine. With tools I can check the "
                    "weather, add numbers, tell the time and search the web.")
PLAIN_QUESTIONS: list[tuple[list[str], str, str]] = [
    (["Hello!", "Hi there!", "Hello", "Hi!", "Good morning!", "Hey!"],
     "The user greets me. I will greet them back and offer help.",
     "Hello! How can I help you today?"),
    (["Who are you?", "What are you?", "What can you do?", "Tell me about yourself."],
     "The user asks who I am. I will describe myself and my tools.", SELF_DESCRIPTION),
    (["Thanks!", "Thank you!", "Thank you very much.", "Great, thanks."],
     "The user thanks me. I will reply politely.", "You are welcome! Anything else?"),
]
WEATHER_QUESTIONS = [
    "What is the weather like in {city}{unit_part}?", "What's the weather in {city}{unit_part}?",
    "How warm is it in {city}{unit_part}?", "Weather in {city}{unit_part}, please.",
    "Is it sunny in {city}{unit_part}?", "Tell me the weather in {city}{unit_part}.",
]
ADD_QUESTIONS = ["What is {a} plus {b}?", "Add {a} and {b}.", "What is {a} + {b}?",
                 "Compute the sum of {a} and {b}.", "Please add {a} to {b}."]
TIME_QUESTIONS = ["What time is it in {city}?", "What is the current time in {city}?",
                  "Tell me the time in {city}.", "What time is it in the {tz} timezone?"]
SEARCH_QUESTIONS = ["Search the web for {query}.", "Find {n} results about {query}.",
                    "Look up {query} online, top {n} results.", "Search for {query}.",
                    "Give me {n} web results on {query}."]


@dataclass
class Example:
    """One training example: the prompt as the server renders it, and the target output."""

    # The conversation so far (history as an OpenAI client sends it back).
    messages: list[dict[str, Any]]
    # The OpenAI tools list, or None for a chat without tools.
    tools: list[dict[str, Any]] | None
    # The raw model output to learn, ending with <|im_end|>.
    completion: str
    # chat_template_kwargs.enable_thinking; False pre-fills an empty think block.
    enable_thinking: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def _number(rng: random.Random) -> int | float:
    if rng.random() < 0.25:
        return rng.randint(0, 999) / 10 if rng.random() < 0.5 else rng.randint(0, 99) + 0.5
    return rng.randint(0, 999) if rng.random() < 0.7 else rng.randint(0, 20)


def _output(reasoning: str | None, answer: str) -> str:
    """A Qwen3 output: ``<think>`` block (when thinking) then the answer, then end of turn."""
    if reasoning is None:
        return answer + "<|im_end|>"
    return f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>"


def _call_text(name: str, arguments: dict[str, Any]) -> str:
    # Arguments as the parser's canonical JSON (json.dumps defaults) so a call
    # sent back through the template renders exactly as the model wrote it.
    return (f'<tool_call>\n{{"name": "{name}", "arguments": '
            f'{json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>')


class CorpusGenerator:
    """Seeded synthetic chats in the Qwen3 format; ``examples(n)`` draws ``n``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def plain(self) -> tuple[str, str, str]:
        """(question, reasoning, answer) needing no tool."""
        rng = self.rng
        if rng.random() < 0.6:
            country, capital = rng.choice(list(COUNTRIES.items()))
            question = rng.choice([f"What is the capital of {country}?",
                                   f"Which city is the capital of {country}?",
                                   f"Tell me the capital of {country}.",
                                   f"Name the capital of {country}."])
            return (question, f"The user asks for the capital of {country}. No tool is needed: "
                              f"the capital of {country} is {capital}.",
                    f"The capital of {country} is {capital}.")
        questions, reasoning, answer = rng.choice(PLAIN_QUESTIONS)
        return rng.choice(questions), reasoning, answer

    def tool_task(self) -> tuple[str, str, str, dict[str, Any]]:
        """(question, reasoning, tool name, arguments) for a question that needs a tool."""
        rng = self.rng
        kind = rng.choice(["get_weather", "get_weather", "add", "get_time", "search"])
        if kind == "get_weather":
            city = rng.choice(list(CITIES))
            unit = rng.choice(["celsius", "fahrenheit"])
            said = rng.random() < 0.7
            unit_part = rng.choice([f" in {unit}", f" in {unit.capitalize()}"]) if said else ""
            if not said:
                unit = "celsius"
            question = rng.choice(WEATHER_QUESTIONS).format(city=city, unit_part=unit_part)
            why = f"in {unit}" if said else f"with no unit given, so I use {unit}"
            reasoning = (f"The user wants the current weather in {city}, {why}. I will call "
                         f"get_weather with city {city} and unit {unit}.")
            return question, reasoning, kind, {"city": city, "unit": unit}
        if kind == "add":
            a, b = _number(rng), _number(rng)
            question = rng.choice(ADD_QUESTIONS).format(a=a, b=b)
            reasoning = (f"The user wants the sum of {a} and {b}. I will call add with a {a} "
                         f"and b {b}.")
            return question, reasoning, kind, {"a": a, "b": b}
        if kind == "get_time":
            city = rng.choice(list(CITIES))
            tz = CITIES[city]
            question = rng.choice(TIME_QUESTIONS).format(city=city, tz=tz)
            where = f"the {tz} timezone" if tz in question else f"{city}, which is in {tz}"
            reasoning = (f"The user wants the time in {where}. I will call get_time with "
                         f"timezone {tz}.")
            return question, reasoning, kind, {"timezone": tz}
        query = rng.choice(TOPICS)
        n = rng.randint(1, 5)
        template = rng.choice(SEARCH_QUESTIONS)
        if "{n}" not in template:
            n = 3
        question = template.format(query=query, n=n)
        reasoning = (f"The user wants web results about {query}. I will call search with query "
                     f"{query} and max_results {n}.")
        return question, reasoning, kind, {"query": query, "max_results": n}

    def answer_from_result(self, name: str, arguments: dict[str, Any],
                           result: dict[str, Any]) -> tuple[str, str]:
        """(reasoning, answer) of the turn after the tool result."""
        if name == "get_weather":
            facts = f"{result['temperature']} degrees {result['unit']} and {result['condition']}"
            return (f"get_weather says it is {facts} in {result['city']}. I can answer now.",
                    f"It is {facts} in {result['city']} right now.")
        if name == "add":
            total = json.dumps(result["result"])
            return (f"add returned {total}. I can answer now.",
                    f"{arguments['a']} plus {arguments['b']} is {total}.")
        if name == "get_time":
            return (f"get_time says it is {result['time']} in {result['timezone']}. "
                    "I can answer now.",
                    f"The current time in {result['timezone']} is {result['time']}.")
        titles = result["results"]
        return (f"search returned {len(titles)} results for {result['query']}. I will list them.",
                f"Here is what I found about {result['query']}: " + "; ".join(titles) + ".")

    def _prefix(self, with_tools: bool) -> list[dict[str, Any]]:
        """Optional system prompt and an earlier exchange, so history does not surprise it."""
        rng = self.rng
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.1:
            question, _, answer = self.plain()
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]
        return messages

    def conversation(self) -> list[Example]:
        """One chat, as one example per assistant turn."""
        rng = self.rng
        with_tools = rng.random() < 0.8
        tools = TOOLS if with_tools else None
        messages = self._prefix(with_tools)
        thinking = rng.random() >= 0.1
        kwargs = {} if thinking and rng.random() < 0.5 else {"enable_thinking": thinking}
        if not with_tools or rng.random() < 0.25:
            question, reasoning, answer = self.plain()
            messages.append({"role": "user", "content": question})
            return [Example(messages, tools, _output(reasoning if thinking else None, answer),
                            thinking, kwargs)]
        question, reasoning, name, arguments = self.tool_task()
        messages.append({"role": "user", "content": question})
        first = Example(list(messages), tools,
                        _output(reasoning if thinking else None, _call_text(name, arguments)),
                        thinking, kwargs)
        result_text = demo_tools.run_tool(name, arguments, now=_random_now(rng))
        call_id = f"call_{rng.getrandbits(64):016x}"
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": name,
                             "arguments": json.dumps(arguments, ensure_ascii=False)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result_text},
        ]
        reasoning2, answer = self.answer_from_result(name, arguments, json.loads(result_text))
        second = Example(list(messages), tools,
                         _output(reasoning2 if thinking else None, answer), thinking, kwargs)
        return [first, second]

    def examples(self, n: int) -> list[Example]:
        out: list[Example] = []
        while len(out) < n:
            out += self.conversation()
        return out[:n]


def _random_now(rng: random.Random) -> Any:
    import datetime as dt

    return dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
        minutes=rng.randrange(24 * 60))


def render_prompts(examples: list[Example]) -> list[str]:
    """Each example's prompt text through the chat template, as the server renders it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    out = []
    for ex in examples:
        texts, _ = render_jinja_template([ex.messages], tools=ex.tools, chat_template=CHAT_TEMPLATE,
                                         add_generation_prompt=True, **ex.template_kwargs)
        out.append(texts[0])
    return out


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Byte-level BPE on ``texts`` plus Qwen3's specials and tags, as a transformers tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def strip_markers(text: str) -> str:
        for marker in SPECIAL_TOKENS + TAG_TOKENS:
            text = text.replace(marker, "\n")
        return text

    tok.train_from_iterator((strip_markers(t) for t in texts), trainer)
    # The tags are ordinary added tokens (as in Qwen3): kept in decoded text for the parsers.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------- training

@dataclass
class Encoded:
    """One example as token ids: a shared ``prefix`` (the system block) and the ``rest``;
    the loss covers ``rest[loss_start:]``, the completion."""

    prefix: tuple[int, ...]
    rest: list[int]
    loss_start: int


def encode(tokenizer: Any, examples: list[Example], prompts: list[str]) -> list[Encoded]:
    """Token ids per example; the system block is split off so batches can share it."""
    out = []
    for ex, prompt in zip(examples, prompts, strict=True):
        # Prompt and output tokenized apart, as the engine sees them.
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(ex.completion, add_special_tokens=False)
        cut = prompt.find("<|im_start|>user")
        prefix = tokenizer.encode(prompt[:cut], add_special_tokens=False) if cut > 0 else []
        if p[:len(prefix)] != prefix:  # never expected: a token across the cut
            prefix = []
        out.append(Encoded(tuple(prefix), p[len(prefix):] + c, len(p) - len(prefix)))
    return out


def make_model(tokenizer: Any, args: argparse.Namespace) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config)
    model.config.use_cache = True
    return model


def batches(data: list[Encoded], batch_size: int, rng: random.Random) -> list[list[Encoded]]:
    """Batches of examples sharing one prefix, similar lengths together, in shuffled order."""
    groups: dict[tuple[int, ...], list[Encoded]] = {}
    for e in data:
        groups.setdefault(e.prefix, []).append(e)
    out = []
    for prefix in sorted(groups, key=lambda p: (len(p), p)):
        group = sorted(groups[prefix], key=lambda e: (len(e.rest), rng.random()))
        out += [group[i: i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(out)
    return out


def batch_loss(model: Any, batch: list[Encoded], pad_id: int) -> torch.Tensor:
    """Mean next-token loss over the completion tokens of ``batch`` (one shared prefix).

    The prefix runs once; its keys/values are broadcast to every row (gradients
    flow back through them), which is exact and several times cheaper than
    repeating a ~370-token tools block in each row.
    """
    from transformers import DynamicCache

    prefix = batch[0].prefix
    width = max(len(e.rest) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), len(prefix) + width), dtype=torch.long)
    mask[:, :len(prefix)] = 1
    target = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.rest)
        ids[row, :n] = torch.tensor(e.rest)
        mask[row, len(prefix): len(prefix) + n] = 1
        # position t predicts token t+1; supervise predictions of completion tokens.
        target[row, e.loss_start - 1: n - 1] = torch.tensor(e.rest[e.loss_start:])
    cache = None
    if prefix:
        shared = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
        cache = DynamicCache(config=model.config)
        for i, layer in enumerate(shared.layers):
            cache.update(layer.keys.expand(len(batch), -1, -1, -1),
                         layer.values.expand(len(batch), -1, -1, -1), i)
    hidden = model.model(input_ids=ids, attention_mask=mask, past_key_values=cache,
                         use_cache=cache is not None).last_hidden_state
    keep = target != -100
    # Only supervised positions go through the LM head.
    logits = model.lm_head(hidden[keep])  # [num_supervised, vocab]
    return torch.nn.functional.cross_entropy(logits, target[keep])


def train(model: Any, data: list[Encoded], pad_id: int, args: argparse.Namespace) -> float:
    """AdamW with warm-up and cosine decay for ``args.steps`` steps; returns the final loss
    (mean of the last 20 steps)."""
    rng = random.Random(args.seed + 1)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    queue: list[list[Encoded]] = []
    recent: list[float] = []
    start = time.perf_counter()
    epoch = 0
    for step in range(args.steps):
        if not queue:
            queue = batches(data, args.batch_size, rng)
            epoch += 1
        batch = queue.pop()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = batch_loss(model, batch, pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-20:]
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            print(f"step {step + 1:5d}/{args.steps}  epoch {epoch}  loss {loss.item():.4f}  "
                  f"avg20 {sum(recent) / len(recent):.4f}  lr {lr_at(step):.2e}  "
                  f"{elapsed:6.0f}s elapsed, ~{eta:.0f}s left", flush=True)
    model.eval()
    return sum(recent) / len(recent)


# --------------------------------------------------------------------------- checks

def greedy_chat(model: Any, tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, max_new_tokens: int = 160) -> str:
    """Greedy output text (tags kept, special tokens dropped) of the HF model for a chat."""
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def check_demo_behaviour(model: Any, tokenizer: Any, verbose: bool = True) -> list[str]:
    """Problems with greedy answers to the demo prompts (empty list: all good).

    Uses the ``qwen3`` tool and reasoning parsers, as the server does.
    """
    from inference_engine.parsing import parse_output

    problems: list[str] = []

    def parse(text: str) -> Any:
        return parse_output(text, "qwen3", "qwen3", tools=TOOLS)

    plain = [{"role": "user", "content": demo_tools.DEMO_PLAIN_QUESTION}]
    text = greedy_chat(model, tokenizer, plain, None)
    result = parse(text)
    if verbose:
        print(f"  plain: {text!r}")
    if not result.reasoning or not result.content or result.tool_calls:
        problems.append(f"plain question: expected reasoning and content, no call; got {text!r}")

    messages: list[dict[str, Any]] = [{"role": "user", "content": demo_tools.DEMO_TOOL_QUESTION}]
    text = greedy_chat(model, tokenizer, messages, TOOLS)
    result = parse(text)
    if verbose:
        print(f"  tool call: {text!r}")
    if not result.reasoning:
        problems.append(f"tool question: no reasoning in {text!r}")
    if len(result.tool_calls) != 1:
        problems.append(f"tool question: expected one tool call in {text!r}")
        return problems
    call = result.tool_calls[0]["function"]
    try:
        arguments = demo_tools.check_arguments(call["name"], call["arguments"])
    except ValueError as exc:
        problems.append(f"tool question: {exc}")
        return problems
    messages += [{"role": "assistant", "content": None, "tool_calls": result.tool_calls},
                 {"role": "tool", "tool_call_id": result.tool_calls[0]["id"],
                  "content": demo_tools.run_tool(call["name"], arguments)}]
    text = greedy_chat(model, tokenizer, messages, TOOLS)
    final = parse(text)
    if verbose:
        print(f"  final answer: {text!r}")
    if not final.content or final.tool_calls:
        problems.append(f"after the tool result: expected a final answer, got {text!r}")
    return problems


def held_out_accuracy(model: Any, tokenizer: Any, num: int, seed: int) -> float:
    """Share of fresh tool questions answered with exactly the intended call."""
    from inference_engine.parsing import parse_output

    gen = CorpusGenerator(seed)
    correct = 0
    for _ in range(num):
        question, _, name, arguments = gen.tool_task()
        text = greedy_chat(model, tokenizer, [{"role": "user", "content": question}], TOOLS, 96)
        calls = parse_output(text, "qwen3", "qwen3", tools=TOOLS).tool_calls
        if len(calls) == 1 and calls[0]["function"]["name"] == name and \
                json.loads(calls[0]["function"]["arguments"]) == arguments:
            correct += 1
    return correct / num


def weights_digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (fixed for determinism)")
    p.add_argument("--num-examples", type=int, default=12000, help="corpus size (examples)")
    p.add_argument("--vocab-size", type=int, default=3072, help="BPE vocabulary before added tags")
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--batch-size", type=int, default=16, help="examples per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--held-out", type=int, default=40, help="fresh tool questions to score")
    p.add_argument("--check", action="store_true", help="only check the model saved at --out")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue training this saved model (keeps its tokenizer)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    if args.check:
        tokenizer = AutoTokenizer.from_pretrained(args.out)
        model = Qwen3ForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    else:
        t0 = time.perf_counter()
        print(f"==> generating {args.num_examples} synthetic chat examples (seed {args.seed})",
              flush=True)
        examples = CorpusGenerator(args.seed).examples(args.num_examples)
        prompts = render_prompts(examples)
        if args.init_from is not None:
            print(f"==> continuing from {args.init_from}", flush=True)
            tokenizer = AutoTokenizer.from_pretrained(args.init_from)
        else:
            print(f"==> training a byte-level BPE tokenizer ({args.vocab_size} tokens + "
                  f"{len(TAG_TOKENS)} tags)", flush=True)
            # A few thousand examples hold every word; more only slow the BPE trainer down.
            texts = [p + e.completion for p, e in zip(prompts[:4000], examples, strict=False)]
            tokenizer = train_tokenizer(texts, args.vocab_size)
        data = encode(tokenizer, examples, prompts)
        lengths = [len(e.prefix) + len(e.rest) for e in data]
        supervised = sum(len(e.rest) - e.loss_start for e in data)
        print(f"    {len(data)} examples, {sum(lengths)} tokens ({supervised} supervised), "
              f"length {min(lengths)}-{max(lengths)}", flush=True)
        if args.init_from is not None:
            model = Qwen3ForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
            previous = json.loads((args.init_from / "training_info.json").read_text())
        else:
            model = make_model(tokenizer, args)
            previous = None
        num_params = sum(p.numel() for p in model.parameters())
        print(f"==> training Qwen3ForCausalLM ({num_params / 1e6:.2f}M parameters, fp32, "
              f"{args.threads} threads) for {args.steps} steps", flush=True)
        final_loss = train(model, data, tokenizer.pad_token_id, args)
        train_seconds = time.perf_counter() - t0
        args.out.mkdir(parents=True, exist_ok=True)
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
        model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out, save_jinja_files=False)
        info = {"seed": args.seed, "steps": args.steps, "num_examples": args.num_examples,
                "final_loss": round(final_loss, 4), "train_seconds": round(train_seconds, 1),
                "threads": args.threads, "num_parameters": num_params,
                "weights_sha256_16": weights_digest(model), "torch": torch.__version__,
                "lr": args.lr, "batch_size": args.batch_size}
        if previous is not None:
            info["continued_from"] = previous
        (args.out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"==> saved to {args.out}: final loss {final_loss:.4f}, {train_seconds:.0f}s, "
              f"weights digest {info['weights_sha256_16']}", flush=True)
    print("==> checking greedy answers to the demo prompts", flush=True)
    problems = check_demo_behaviour(model, tokenizer)
    if args.held_out:
        accuracy = held_out_accuracy(model, tokenizer, args.held_out, seed=args.seed + 1000)
        print(f"    exact tool calls on {args.held_out} fresh questions: {accuracy:.0%}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("==> demo behaviour OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
