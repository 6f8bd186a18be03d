"""The sparse MLA decode: torch reference against plain attention, Triton kernel against both.

The reference (:func:`sparse_latent_attention_torch`) is checked against
softmax attention over the selected latents gathered position by position in
Python order; the Triton kernel must match the reference. ``triton.jit``
decides at import whether it interprets, so the kernel cases run in a child
pytest with ``TRITON_INTERPRET=1`` (float32).
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.layers.sparse_mla import sparse_latent_attention_torch
from inference_engine.testing import run_under_triton_interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")

BLOCK_SIZE = 4


def case(n: int, heads: int, rank: int, rope: int, seq_lens: list[int], k: int, seed: int):
    """A pool view with random entries (NaN in unused slots), block tables, absorbed queries
    and each sequence's selection (ascending, -1 padded)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # A strided view, as the pool hands out: another layer's bytes sit between blocks.
    storage = torch.randn(num_blocks, BLOCK_SIZE * (rank + rope) + 24, generator=gen)
    cache = storage[:, 24:].view(num_blocks, BLOCK_SIZE, 1, rank + rope)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(n, max(blocks_per_seq), dtype=torch.int64)
    used = 0
    for i, b in enumerate(blocks_per_seq):
        tables[i, :b] = torch.tensor(perm[used:used + b])
        used += b
    for i, s in enumerate(seq_lens):  # slots past a sequence's end hold garbage
        last = tables[i, (s - 1) // BLOCK_SIZE]
        cache[last, (s - 1) % BLOCK_SIZE + 1:] = float("nan")
    positions = torch.full((n, k), -1, dtype=torch.int64)
    for i, s in enumerate(seq_lens):
        keep = torch.randperm(s, generator=gen)[:k].sort().values
        positions[i, :keep.numel()] = keep
    q = torch.randn(n, heads, rank + rope, generator=gen)
    return q, cache, positions, tables


def plain_attention(q, cache, positions, tables, rank, scale):
    out = torch.zeros(q.shape[0], q.shape[1], rank)
    for i in range(q.shape[0]):
        picks = [p for p in positions[i].tolist() if p >= 0]
        entries = torch.stack([cache[tables[i, p // BLOCK_SIZE], p % BLOCK_SIZE, 0]
                               for p in picks])
        probs = (q[i] @ entries.T * scale).softmax(-1)
        out[i] = probs @ entries[:, :rank]
    return out


CASES = [(3, 4, 32, 8, [9, 40, 17], 8), (2, 20, 64, 16, [70, 5], 32), (1, 16, 16, 8, [1], 4)]


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "passed" in stdout and "failed" not in stdout, stdout[-2000:]


@pytest.mark.parametrize(("n", "heads", "rank", "rope", "seq_lens", "k"), CASES)
def test_reference_equals_plain_attention(n, heads, rank, rope, seq_lens, k):
    q, cache, positions, tables = case(n, heads, rank, rope, seq_lens, k, seed=k)
    got = sparse_latent_attention_torch(q, cache, positions, tables, rank, 0.3)
    torch.testing.assert_close(got, plain_attention(q, cache, positions, tables, rank, 0.3),
                               atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize(("n", "heads", "rank", "rope", "seq_lens", "k"), CASES)
def test_triton_kernel_equals_reference(n, heads, rank, rope, seq_lens, k):
    from inference_engine.layers.triton_sparse_mla import sparse_latent_attention_triton

    q, cache, positions, tables = case(n, heads, rank, rope, seq_lens, k, seed=k)
    expected = sparse_latent_attention_torch(q, cache, positions, tables, rank, 0.3)
    got = sparse_latent_attention_triton(q, cache, positions, tables, rank, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
