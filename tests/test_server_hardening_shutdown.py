"""Shutdown past ``--shutdown-timeout`` (issue 32): streams end properly, 0 means at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from inference_engine.testing import TEST_PLATFORM, ServerProcess


def _stream(url: str, out: list, started: threading.Event) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:
        out.append(exc)
    started.set()


@pytest.mark.parametrize("timeout", ["0", "1"])
def test_streams_end_with_an_abort_and_done_when_the_drain_time_is_up(tiny_model_dirs,
                                                                      timeout):
    server = ServerProcess(tiny_model_dirs["qwen3"], "--shutdown-timeout", timeout,
                           platform=TEST_PLATFORM)
    out: list = []
    started = threading.Event()
    reader = threading.Thread(target=_stream, args=(server.url, out, started))
    reader.start()
    assert started.wait(60)
    if timeout != "0":
        httpx.post(server.url + "/pause")  # the request can now never finish by itself
    began = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert server.proc.wait(60) == 0, server.log()
    assert time.monotonic() - began < float(timeout) + 20
    assert out[-1] == "[DONE]", out[-3:]
    last = json.loads(out[-2])
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert "Traceback" not in server.log(), server.log()
