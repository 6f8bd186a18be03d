"""The `make demo` client: talks to a running `inference-engine serve` with the `openai` package.

    python scripts/demo_client.py --base-url http://127.0.0.1:8000 --api-key KEY

Streams (a) a plain answer, (b) a question the model answers with a tool call:
the parsed ``reasoning_content`` and ``tool_calls`` are printed, the arguments
checked against the tool's JSON schema, the tool run here and its result sent
back for the final answer; then shows (c) ``/tokenize`` and ``/metrics``.
Exits 1 with a message naming the failed step. The server must run the
``qwen3`` tool and reasoning parsers with ``--enable-auto-tool-choice``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_tools  # noqa: E402  (the sibling module; scripts/ is not a package)

MAX_TOKENS = 160


class DemoError(RuntimeError):
    """A demo step did not give what it should."""


@dataclass
class StreamedMessage:
    """What one streamed chat completion added up to."""

    reasoning: str = ""
    content: str = ""
    # index -> {"id", "name", "arguments"}
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish_reason: str | None = None


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def stream_chat(client: openai.OpenAI, model: str, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> StreamedMessage:
    """Stream one greedy chat completion, echoing reasoning and content as they arrive."""
    extra = {"tools": tools} if tools else {}
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_tokens=MAX_TOKENS, stream=True, **extra)
    out = StreamedMessage()
    section = None
    shown = {"reasoning_content": "", "content": ""}  # text so far, leading blanks dropped
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning = (delta.model_extra or {}).get("reasoning_content") or ""
        for name, text in (("reasoning_content", reasoning), ("content", delta.content or "")):
            if not shown[name]:
                text = text.lstrip()
            if not text:
                continue
            if section != name:
                print(f"\n  [{name}] ", end="", flush=True)
                section = name
            shown[name] += text
            print(text, end="", flush=True)
        out.reasoning += reasoning
        out.content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = out.tool_calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            if call.id:
                entry["id"] = call.id
            if call.function and call.function.name:
                entry["name"] = call.function.name
            if call.function and call.function.arguments:
                entry["arguments"] += call.function.arguments
        out.finish_reason = choice.finish_reason or out.finish_reason
    print(f"\n  [finish_reason] {out.finish_reason}", flush=True)
    return out


def plain_answer(client: openai.OpenAI, model: str) -> None:
    step(f"(a) plain answer, streamed: {demo_tools.DEMO_PLAIN_QUESTION!r}")
    out = stream_chat(client, model, [{"role": "user", "content": demo_tools.DEMO_PLAIN_QUESTION}])
    if not out.reasoning.strip():
        raise DemoError("(a) the answer has no reasoning_content")
    if not out.content.strip():
        raise DemoError("(a) the answer has no content")
    if out.tool_calls:
        raise DemoError("(a) the model called a tool for a plain question")


def tool_round_trip(client: openai.OpenAI, model: str) -> None:
    question = demo_tools.DEMO_TOOL_QUESTION
    step(f"(b) tool call, streamed: {question!r} with tools "
         f"{[t['function']['name'] for t in demo_tools.TOOLS]}")
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    out = stream_chat(client, model, messages, demo_tools.TOOLS)
    print("\n  parsed by the server's qwen3 parsers:")
    print(f"    reasoning_content: {out.reasoning.strip()!r}")
    if not out.reasoning.strip():
        raise DemoError("(b) no reasoning_content")
    if out.finish_reason != "tool_calls" or len(out.tool_calls) != 1:
        raise DemoError(f"(b) expected one tool call and finish_reason 'tool_calls', got "
                        f"{len(out.tool_calls)} call(s), finish_reason {out.finish_reason!r}, "
                        f"content {out.content!r}")
    call = out.tool_calls[0]
    print(f"    tool_calls[0]: id={call['id']} name={call['name']} "
          f"arguments={call['arguments']}")
    try:
        arguments = demo_tools.check_arguments(call["name"], call["arguments"])
    except ValueError as exc:
        raise DemoError(f"(b) {exc}") from None
    print(f"  arguments validate against the {call['name']} JSON schema: "
          f"{json.dumps(demo_tools.tool_schema(call['name']))}")
    result = demo_tools.run_tool(call["name"], arguments)
    print(f"  ran {call['name']}({', '.join(f'{k}={v!r}' for k, v in arguments.items())}) "
          f"-> {result}")

    step("(b) sending the tool result back for the final answer, streamed")
    messages += [
        {"role": "assistant", "content": out.content.strip() or None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]
    final = stream_chat(client, model, messages, demo_tools.TOOLS)
    if final.tool_calls or not final.content.strip():
        raise DemoError(f"(b) expected a final answer, got content {final.content!r} and "
                        f"{len(final.tool_calls)} tool call(s)")
    print(f"\n  final answer: {final.content.strip()}")


def endpoints(base_url: str, api_key: str, model: str) -> None:
    step("(c) /tokenize and /metrics")
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=base_url, timeout=30.0) as http:
        response = http.post("/tokenize", headers=headers, json={
            "model": model,
            "messages": [{"role": "user", "content": demo_tools.DEMO_TOOL_QUESTION}],
            "return_token_strs": True})
        if response.status_code != 200:
            raise DemoError(f"(c) /tokenize answered {response.status_code}: {response.text}")
        body = response.json()
        strs = body.get("token_strs") or []
        print(f"  POST /tokenize (chat template applied): count={body['count']} "
              f"max_model_len={body['max_model_len']}")
        print(f"    first tokens: {strs[:12]}")
        unauthorized = http.get("/metrics")
        print(f"  GET /metrics without the API key -> {unauthorized.status_code}")
        if unauthorized.status_code != 401:
            raise DemoError(f"(c) /metrics without a key answered {unauthorized.status_code}, "
                            f"expected 401")
        response = http.get("/metrics", headers=headers)
        if response.status_code != 200:
            raise DemoError(f"(c) /metrics answered {response.status_code}: {response.text}")
        wanted = ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
                  "time_to_first_token_seconds_count", "kv_cache_usage_perc")
        lines = [line for line in response.text.splitlines()
                 if not line.startswith("#") and any(w in line for w in wanted)]
        print("  GET /metrics (excerpt):")
        for line in lines:
            print(f"    {line}")
        if not any("generation_tokens_total" in line for line in lines):
            raise DemoError("(c) /metrics has no generation_tokens_total")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server address, without /v1")
    parser.add_argument("--api-key", default="EMPTY", help="a key the server accepts")
    parser.add_argument("--model", default=None, help="served model name; default the first")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key,
                           max_retries=0, timeout=300.0)
    try:
        model = args.model or client.models.list().data[0].id
        print(f"client: openai {openai.__version__}, {args.base_url}, model {model!r}")
        plain_answer(client, model)
        tool_round_trip(client, model)
        endpoints(args.base_url.rstrip("/"), args.api_key, model)
    except DemoError as exc:
        print(f"\nDEMO FAILED: {exc}", file=sys.stderr)
        return 1
    except openai.OpenAIError as exc:
        print(f"\nDEMO FAILED: the server refused a request: {exc}", file=sys.stderr)
        return 1
    print("\nclient: all steps passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
