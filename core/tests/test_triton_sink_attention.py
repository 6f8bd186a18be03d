"""The Triton V4 decode attention (one K=V head, sinks, per-query keys) against its torch
reference, under ``TRITON_INTERPRET=1`` in a child pytest (float32; bf16 is broken in the
interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from inference_engine.layers.compressed_attention import sink_attention  # noqa: E402
from inference_engine.testing import run_under_triton_interpreter  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    stdout = run_under_triton_interpreter(__file__)
    assert "3 passed" in stdout and "failed" not in stdout, stdout[-2000:]


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize(("n", "heads", "keys", "dim"), [(3, 4, 37, 32), (2, 20, 16, 24),
                                                         (1, 16, 50, 8)])
def test_matches_the_torch_reference(n, heads, keys, dim):
    """Ragged heads/keys/dims, masked keys anywhere (a whole 16-key block of the first query
    included) and strong sinks, within float32 rounding of ``sink_attention``."""
    from inference_engine.layers.triton_sink_attention import sink_attention_triton

    gen = torch.Generator().manual_seed(n * 100 + heads)
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(n, keys, dim, generator=gen)
    mask = torch.rand(n, keys, generator=gen) < 0.7
    mask[:, -1] = True  # every query sees at least one key
    mask[0, :16] = False
    k[~mask] = float("nan")  # masked keys must not leak (the engine zeroes them; be strict)
    sinks = 3 * torch.randn(heads, generator=gen)
    got = sink_attention_triton(q, k, mask, sinks, 0.3)
    ref = sink_attention(q, torch.nan_to_num(k), mask, sinks, 0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
