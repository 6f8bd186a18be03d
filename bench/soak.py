"""Load and fault soak of the OpenAI server: a bounded mix of good and hostile clients for
N minutes against one server, then an account of every request.

Clients (``--concurrency`` of them, each picking at random): whole and streamed
completions and chats, streams the client drops midway, requests aborted by id
through ``/abort_requests``, slow readers, bad requests (wrong types, bad
``tool_choice``, bad ``request_id``), oversized bodies, and now and then a short
``/pause`` + ``/resume``. A poller hits ``/health`` every 0.25 s.

At the end it checks: every accepted request is accounted for (finished with
all its tokens, or ended with an abort or error its client saw, or dropped by
its own client), no 5xx, every refusal a 4xx in the OpenAI shape, the
``/metrics`` gauges back to 0, RSS within ``--rss-bound-mb`` of the start, and
``/health`` answering within 1 s throughout. Exit 1 if any check fails.

Run:  .venv/bin/python bench/soak.py                       # demo model, 2 minutes
      .venv/bin/python bench/soak.py --minutes 10 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from inference_engine.testing import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "Once upon a time", "Paged attention stores keys",
           "In the beginning", "A list of prime numbers:"]


@dataclass
class Tally:
    """What the clients saw."""

    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    health_worst: float = 0.0
    health_failures: int = 0

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)
        self.outcomes["PROBLEM"] += 1


def check_error(tally: Tally, kind: str, r: httpx.Response, status: int | None = None) -> None:
    if r.status_code >= 500 or (status is not None and r.status_code != status):
        tally.problem(f"{kind}: {r.status_code} {r.text[:200]}")
        return
    try:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["code"] == r.status_code
    except Exception:
        tally.problem(f"{kind}: malformed error body {r.text[:200]}")
        return
    tally.outcomes[f"{kind}: refused {r.status_code}"] += 1


async def whole(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    max_tokens = rng.randint(1, 64)
    if rng.random() < 0.5:
        r = await client.post("/v1/completions", json={
            "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "ignore_eos": True,
            "n": rng.choice([1, 1, 2])})
    else:
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": max_tokens, "ignore_eos": True})
    if r.status_code != 200:
        tally.problem(f"whole: {r.status_code} {r.text[:200]}")
        return
    body = r.json()
    n = len(body["choices"])
    if body["usage"]["completion_tokens"] != max_tokens * n or any(
            c["finish_reason"] != "length" for c in body["choices"]):
        tally.problem(f"whole: wrong tokens/finish {body['usage']} "
                      f"{[c['finish_reason'] for c in body['choices']]}")
        return
    tally.outcomes["whole: finished"] += 1


async def stream(client: httpx.AsyncClient, tally: Tally, rng: random.Random,
                 drop_after: int | None = None, slow: float = 0.0,
                 abort_id: str | None = None) -> None:
    """One streamed completion; counts tokens through usage and the finish reason."""
    max_tokens = rng.randint(8, 96)
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if abort_id:
        body["request_id"] = abort_id
    events, finish, usage, done = 0, None, None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            tally.problem(f"stream: {r.status_code}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                finish = "error"
                continue
            events += 1
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
            if abort_id and events == 2:
                await client.post("/abort_requests", json={"request_ids": [abort_id]})
            if drop_after is not None and events >= drop_after:
                tally.outcomes["stream: dropped by client"] += 1
                return
            if slow:
                await asyncio.sleep(slow)
    if not done:
        tally.problem("stream: no [DONE]")
    elif finish == "length" and usage and usage["completion_tokens"] == max_tokens:
        tally.outcomes["stream: finished" + (" (slow reader)" if slow else "")] += 1
    elif finish == "abort" and abort_id:
        tally.outcomes["stream: aborted by id, abort seen"] += 1
    elif finish in ("abort", "error"):
        tally.outcomes[f"stream: ended with {finish}"] += 1
    else:
        tally.problem(f"stream: finish {finish} usage {usage} (max_tokens {max_tokens})")


async def bad(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    choice = rng.randrange(5)
    if choice == 0:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": "10"})
    elif choice == 1:
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes",
            "tools": [{"type": "function", "function": {"name": "f"}}]})
    elif choice == 2:
        r = await client.post("/v1/completions", json={"prompt": "x", "request_id": "a\r\nb"})
    elif choice == 3:
        r = await client.post("/v1/completions", content=b"{not json")
    else:
        r = await client.post("/v1/completions", json={"prompt": "x", "stop": ["s"] * 100})
    check_error(tally, "bad request", r, 400)


async def oversized(client: httpx.AsyncClient, tally: Tally) -> None:
    r = await client.post("/v1/completions", json={"prompt": "word " * 3_000_000})
    check_error(tally, "oversized body", r, 413)


async def pause_resume(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    await client.post("/pause")
    await asyncio.sleep(rng.uniform(0.05, 0.5))
    await client.post("/resume")
    tally.outcomes["pause+resume"] += 1


async def worker(client: httpx.AsyncClient, tally: Tally, seed: int, deadline: float) -> None:
    rng = random.Random(seed)
    count = 0
    while time.monotonic() < deadline:
        count += 1
        kind = rng.random()
        try:
            if kind < 0.25:
                await whole(client, tally, rng)
            elif kind < 0.45:
                await stream(client, tally, rng)
            elif kind < 0.57:
                await stream(client, tally, rng, drop_after=rng.randint(1, 6))
            elif kind < 0.67:
                await stream(client, tally, rng, abort_id=f"soak-{seed}-{count}")
            elif kind < 0.75:
                await stream(client, tally, rng, slow=0.05)
            elif kind < 0.92:
                await bad(client, tally, rng)
            elif kind < 0.97:
                await oversized(client, tally)
            else:
                await pause_resume(client, tally, rng)
        except httpx.HTTPError as exc:
            tally.problem(f"transport: {type(exc).__name__}: {exc}")


async def poll_health(url: str, tally: Tally, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                r = await client.get(url + "/health")
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            took = time.monotonic() - began
            tally.health_worst = max(tally.health_worst, took)
            if not ok or took > 1.0:
                tally.health_failures += 1
            await asyncio.sleep(0.25)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith("inference_engine:") and "{" in line:
            out[line.split("{", 1)[0].removeprefix("inference_engine:")] = \
                float(line.rsplit(" ", 1)[1])
    return out


async def soak(url: str, minutes: float, concurrency: int, seed: int) -> Tally:
    tally = Tally()
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_health(url, tally, stop))
    deadline = time.monotonic() + minutes * 60
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120,
                                 limits=limits) as client:
        await asyncio.gather(*(worker(client, tally, seed * 1000 + i, deadline)
                               for i in range(concurrency)))
    stop.set()
    await poller
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "demo-qwen3-tiny"))
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-bound-mb", type=float, default=100.0,
                        help="most the server's RSS may grow from after warm-up to the end")
    parser.add_argument("--platform", default=os.environ.get("INFERENCE_ENGINE_TEST_PLATFORM"))
    args = parser.parse_args()

    server = ServerProcess(args.model, "--api-key", KEY, "--enable-auth", "--max-num-seqs",
                           "32", kv_cache_memory="64MiB", platform=args.platform)
    try:
        # Warm-up (first forward passes, allocator pools) before the RSS baseline.
        asyncio.run(soak(server.url, 0.1, args.concurrency, args.seed + 1))
        rss_start = rss_mb(server.proc.pid)
        began = time.monotonic()
        tally = asyncio.run(soak(server.url, args.minutes, args.concurrency, args.seed))
        elapsed = time.monotonic() - began
        settle = time.monotonic() + 10
        while time.monotonic() < settle:
            g = gauges(server.url)
            if not g["num_requests_running"] and not g["num_requests_waiting"]:
                break
            time.sleep(0.2)
        rss_end = rss_mb(server.proc.pid)
        code = server.stop()
    finally:
        server.stop()

    print(f"soak: {elapsed:.0f} s, concurrency {args.concurrency}, seed {args.seed}")
    for outcome, n in sorted(tally.outcomes.items()):
        print(f"  {outcome:40s} {n}")
    print(f"  requests accounted for: {sum(tally.outcomes.values())}, problems "
          f"{tally.outcomes['PROBLEM']}")
    gauge_line = ", ".join(f"{k} {g[k]:g}" for k in ("num_requests_running",
                                                      "num_requests_waiting",
                                                      "kv_cache_usage_perc"))
    print(f"  gauges at the end: {gauge_line}; preemptions {g.get('num_preemptions_total', 0):g}")
    print(f"  server RSS: {rss_start:.0f} MB after warm-up -> {rss_end:.0f} MB at the end "
          f"(bound +{args.rss_bound_mb:.0f} MB)")
    print(f"  /health: worst {tally.health_worst * 1000:.0f} ms, "
          f"{tally.health_failures} answers late (> 1 s) or failed")
    print(f"  server exit code {code}")
    for text in tally.problems:
        print("  PROBLEM:", text)
    ok = (not tally.outcomes["PROBLEM"] and tally.health_failures == 0 and code == 0
          and not g["num_requests_running"] and not g["num_requests_waiting"]
          and not g["kv_cache_usage_perc"] and rss_end - rss_start <= args.rss_bound_mb)
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
