"""Decode steps through captured-graph buckets give the tokens of the unpadded batch.

There is no CUDA here, so the "graph" is the CPU platform's emulation below: capture
runs the step function once and replay runs it again over the same persistent buffers,
writing into the tensor captured as its output — exactly the data flow a CUDA graph
has (fixed addresses, fixed bucket size, padded rows). The attention backend is the
graph-safe Triton one under ``TRITON_INTERPRET=1`` (a child pytest, as in
test_triton_attention.py), which is what a GPU step replays.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from inference_engine.builtin.platforms.cpu import CpuPlatform  # noqa: E402
from inference_engine.engine.model_runner import graph_batch_sizes  # noqa: E402
from inference_engine.testing import run_under_triton_interpreter  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_graph_cases_under_the_interpreter():
    stdout = run_under_triton_interpreter(__file__)
    assert "1 skipped" in stdout, stdout[-2000:]


def test_bucket_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256


class _Replay:
    """Replays a captured step by running it again into the captured output tensor."""

    def __init__(self, fn: Any, output: torch.Tensor) -> None:
        self.fn, self.output, self.replays = fn, output, 0

    def replay(self) -> None:
        self.output.copy_(self.fn())
        self.replays += 1


class ReplayingCpuPlatform(CpuPlatform):
    """The CPU platform answering yes to graph capture, with :class:`_Replay` graphs."""

    def __init__(self, device_ids: list[int] | None = None) -> None:
        super().__init__(device_ids)
        self.graphs: list[_Replay] = []

    def supports_graph_capture(self) -> bool:
        return True

    def capture_graph(self, fn: Any, pool: Any = None) -> tuple[Any, Any, Any]:
        output = fn()
        graph = _Replay(fn, output)
        self.graphs.append(graph)
        return graph, output, pool


def _engine(path: Any, monkeypatch: pytest.MonkeyPatch, platform: Any, **kwargs: Any) -> Any:
    from inference_engine.engine import llm_engine
    from inference_engine.entrypoints.llm import LLM

    monkeypatch.setattr(llm_engine, "select_platform", lambda *a, **k: platform)
    return LLM(str(path), dtype="float32", show_progress=False, attention_backend="triton",
               block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
               kv_cache_memory=1 << 22, **kwargs)


@interp
@pytest.mark.parametrize(("temperature", "run_ahead"), [(0.0, False), (0.9, False), (0.9, True)])
def test_padded_buckets_give_the_unpadded_tokens(tmp_path, monkeypatch, temperature, run_ahead):
    from inference_engine import SamplingParams
    from inference_engine.testing import make_tiny_model

    path = make_tiny_model(tmp_path)
    prompts = ["The quick brown fox", "Paged attention stores keys", "a b c", "hello there",
               "one two three four five"]
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, seed=3)

    eager = _engine(path, monkeypatch, CpuPlatform(), enforce_eager=True)
    assert eager.engine.runner.graph_sizes == []
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]

    platform = ReplayingCpuPlatform()
    # run_ahead: async scheduling, pending tokens written into the graph's input buffer.
    graphed = _engine(path, monkeypatch, platform, async_scheduling=run_ahead)
    assert graphed.engine.runner.graph_sizes == [1, 2, 4, 6]
    assert "captured 4 decode batch sizes" in graphed.engine.graphs_message
    # 5 requests fill bucket 6 (one padded row); 3 fill bucket 4; 1 is bucket 1.
    for batch in (prompts, prompts[:3], prompts[:1]):
        got = [o.outputs[0].token_ids for o in graphed.generate(batch, params)]
        assert got == expected[: len(batch)]
    assert sum(g.replays for g in platform.graphs) > 0


@interp
def test_padding_rows_write_nothing_to_the_cache(tmp_path, monkeypatch):
    from inference_engine import SamplingParams
    from inference_engine.testing import make_tiny_model

    path = make_tiny_model(tmp_path)
    graphed = _engine(path, monkeypatch, ReplayingCpuPlatform())
    pool = graphed.engine.runner.pool
    before_null_block = pool.storage[0].clone()
    graphed.generate(["a b c", "hello there", "one two"],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    # Padding rows have slot -1: the null block (and with it every padded read) stays zero.
    assert torch.equal(pool.storage[0], before_null_block)
    assert int(before_null_block.abs().sum()) == 0
