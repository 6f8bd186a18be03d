"""Top-k position selection for sparse attention: the torch reference and the Triton kernel.

The reference is checked against ``torch.topk`` on tie-free rows and against a
plain Python selection (sort by (-score, position)) on rows full of ties and
``-inf``; the Triton kernel must equal the reference exactly. ``triton.jit``
decides at import whether it interprets, so the kernel cases run in a child
pytest with ``TRITON_INTERPRET=1`` (float32).
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.layers.sparse_topk import topk_positions, topk_positions_torch
from inference_engine.testing import run_under_triton_interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


def python_topk(row: list[float], k: int) -> list[int]:
    """The spec, spelled out: finite scores, highest first, lowest position on ties."""
    order = sorted((i for i, s in enumerate(row) if s != float("-inf")),
                   key=lambda i: (-row[i], i))[:k]
    return sorted(order) + [-1] * (k - len(order))


def ragged_scores(rows: int, width: int, seed: int, ties: bool) -> torch.Tensor:
    """Rows of random visible lengths (1..width), ``-inf`` past each; with ``ties`` the
    scores are small integers (many equal, zeros as ReLU makes them)."""
    gen = torch.Generator().manual_seed(seed)
    if ties:
        scores = torch.randint(-1, 4, (rows, width), generator=gen).float().clamp(min=0)
    else:
        scores = torch.randn(rows, width, generator=gen)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    future = torch.arange(width)[None, :] >= lengths[:, None]
    return scores.masked_fill(future, float("-inf"))


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "passed" in stdout and "failed" not in stdout, stdout[-2000:]


def test_reference_equals_torch_topk_without_ties():
    scores = ragged_scores(9, 40, 0, ties=False)
    got = topk_positions_torch(scores, 6)
    for row, picked in zip(scores, got, strict=True):
        visible = int((row > float("-inf")).sum())
        expected = row.topk(min(6, visible)).indices.sort().values.tolist()
        assert picked.tolist() == expected + [-1] * (6 - len(expected))


@pytest.mark.parametrize("k", [1, 5, 16, 64])
def test_reference_breaks_ties_by_lowest_position(k):
    scores = ragged_scores(12, 50, k, ties=True)
    got = topk_positions_torch(scores, k)
    assert got.tolist() == [python_topk(row.tolist(), k) for row in scores]


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="'cuda_magic'"):
        topk_positions(torch.zeros(1, 3), 2, "cuda_magic")


@interp
@pytest.mark.parametrize(("rows", "width", "k", "ties"),
                         [(7, 30, 4, False), (5, 300, 16, True), (3, 2100, 64, False),
                          (4, 9, 32, True), (2, 1, 1, False)])
def test_triton_kernel_equals_reference(rows, width, k, ties):
    from inference_engine.layers.triton_sparse_topk import topk_positions_triton

    scores = ragged_scores(rows, width, rows * width + k, ties)
    # Negative scores too (the indexer's weights may be negative).
    flip = (torch.arange(width)[None, :] % 3 == 0) & scores.isfinite()
    scores = torch.where(flip, -scores, scores)
    expected = topk_positions_torch(scores, k)
    torch.testing.assert_close(topk_positions_triton(scores, k, block=64), expected,
                               rtol=0, atol=0)
    torch.testing.assert_close(topk_positions(scores, k, "triton"), expected, rtol=0, atol=0)
