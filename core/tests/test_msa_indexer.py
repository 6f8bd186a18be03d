"""MSA block selection (``layers/msa_indexer.py``) against a plain loop reference.

Max-pooled causal block scores, local blocks forced in, the best blocks up to
``topk_blocks`` in all. The top-k runs through the shared
:func:`~inference_engine.layers.sparse_topk.topk_positions`: the torch reference
here, and the Triton kernel in a child pytest with ``TRITON_INTERPRET=1``
(``triton.jit`` decides at import whether it interprets).
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.layers.msa_indexer import block_scores, select_blocks
from inference_engine.testing import run_under_triton_interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = ["triton"] if INTERPRETING else ["torch"]


def plain_selection(q: torch.Tensor, keys: torch.Tensor, pos: int, block: int, topk: int,
                    local: int) -> list[set[int]]:
    """Loops: each head's max-per-block score over the keys up to ``pos``, local blocks
    forced, then the best other blocks up to ``topk`` in all."""
    out = []
    for h in range(q.shape[0]):
        scores: dict[int, float] = {}
        for s in range(pos + 1):
            value = float(q[h] @ keys[s])
            scores[s // block] = max(scores.get(s // block, float("-inf")), value)
        forced = {max(pos // block - j, 0) for j in range(local)}
        rest = sorted((b for b in scores if b not in forced), key=lambda b: -scores[b])
        out.append(forced | set(rest[:max(topk - len(forced), 0)]))
    return out


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "passed" in stdout and "failed" not in stdout, stdout[-2000:]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("block", "topk", "local"), [(4, 3, 1), (4, 3, 2), (8, 2, 1)])
def test_selection_matches_plain_reference(impl, block, topk, local):
    gen = torch.Generator().manual_seed(block + topk + local)
    q = torch.randn(10, 2, 16, generator=gen)
    keys = torch.randn(41, 16, generator=gen)
    positions = torch.tensor([0, 3, 4, 11, 17, 22, 29, 33, 36, 40])
    picked = select_blocks(block_scores(q, keys, positions, block), positions, block, topk,
                           local, impl)
    for i, pos in enumerate(positions.tolist()):
        ref = plain_selection(q[i], keys, pos, block, topk, local)
        for h in range(2):
            row = picked[i, h].tolist()
            kept = [b for b in row if b >= 0]
            assert kept == sorted(kept) and row[len(kept):] == [-1] * (topk - len(kept))
            assert set(kept) == ref[h], (pos, h)


def test_per_query_contexts_equal_a_shared_one():
    """Decodes score their own gathered context ``[n, S, D]``: the same blocks as one shared
    context, entries past each query masked."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 16, generator=gen)
    keys = torch.randn(30, 16, generator=gen)
    positions = torch.tensor([12, 20, 29])
    shared = block_scores(q, keys, positions, 4)
    per_query = block_scores(q, keys.expand(3, -1, -1), positions, 4)
    torch.testing.assert_close(per_query, shared)
