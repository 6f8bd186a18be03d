"""Start-up errors and graceful shutdown of ``inference-engine serve``."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from inference_engine.testing import TEST_PLATFORM, ServerProcess, run_cli


def test_enable_auth_without_a_key_fails_at_start(tiny_model_dirs):
    r = run_cli("serve", str(tiny_model_dirs["qwen3"]), "--enable-auth")
    assert r.returncode == 2
    assert "--enable-auth" in r.stderr and "INFERENCE_ENGINE_API_KEY" in r.stderr


@pytest.mark.parametrize(("flag", "value", "listed"), [
    ("--tool-call-parser", "no_such_parser", "qwen3"),
    ("--reasoning-parser", "no_such_parser", "deepseek_r1"),
])
def test_unknown_parser_fails_before_loading(tiny_model_dirs, flag, value, listed):
    r = run_cli("serve", str(tiny_model_dirs["qwen3"]), flag, value)
    assert r.returncode == 2
    assert value in r.stderr and listed in r.stderr
    assert "KV cache" not in r.stderr  # the model was never loaded


@pytest.mark.parametrize("args", [
    ["--tool-call-streaming", "sometimes"], ["--port", "70000"], ["--kv-cache-memory", "lots"],
    ["--dtype", "int3"],
])
def test_bad_flags_exit_2(tiny_model_dirs, args):
    r = run_cli("serve", str(tiny_model_dirs["qwen3"]), *args)
    assert r.returncode == 2, r.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path):
    r = run_cli("serve", str(tmp_path / "nope"))
    assert r.returncode == 2 and "nope" in r.stderr


def _stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out.append(json.loads(line[6:]))
                    started.set()
    except httpx.HTTPError as exc:
        out.append(exc)
    started.set()


def test_sigint_finishes_in_flight_requests_then_exits_0(tiny_model_dirs):
    server = ServerProcess(tiny_model_dirs["qwen3"], "--max-num-seqs", "4",
                           platform=TEST_PLATFORM)
    out: list = []
    started = threading.Event()
    body = {"prompt": "The quick brown fox", "max_tokens": 300, "ignore_eos": True}
    t = threading.Thread(target=_stream, args=(server.url, body, out, started))
    t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGINT)
    t.join(60)
    assert server.proc.wait(60) == 0, server.log()
    assert isinstance(out[-1], dict) and out[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(ch["choices"]) for ch in out) >= 2
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)


def test_sigterm_past_the_shutdown_timeout_aborts_and_exits_0(tiny_model_dirs):
    server = ServerProcess(tiny_model_dirs["qwen3"], "--shutdown-timeout", "1",
                           platform=TEST_PLATFORM)
    out: list = []
    started = threading.Event()
    body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True}
    t = threading.Thread(target=_stream, args=(server.url, body, out, started))
    t.start()
    assert started.wait(60)
    httpx.post(server.url + "/pause")  # the request can now never finish by itself
    began = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.log()
    assert time.monotonic() - began < 30
    t.join(30)
    assert not t.is_alive()
    assert "aborted" in server.log() or "Cancel" in server.log()


def test_a_port_taken_before_the_server_binds_it_is_retried(tiny_model_dirs, monkeypatch):
    """free_port() can hand out a port that another process takes before the server binds
    it (parallel tests); the server then exits naming the address and ServerProcess starts
    it again on another port instead of failing the test."""
    import socket

    from inference_engine import testing

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    real = testing.free_port
    ports = iter([busy])
    monkeypatch.setattr(testing, "free_port", lambda: next(ports, None) or real())
    try:
        proc = ServerProcess(tiny_model_dirs["qwen3"], platform=TEST_PLATFORM)
    finally:
        taken.close()
    try:
        assert proc.port != busy
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    finally:
        assert proc.stop() == 0
