"""The Triton grouped LoRA kernels against the torch reference, in float32 under
``TRITON_INTERPRET=1`` (a child pytest: ``triton.jit`` decides at import whether it
interprets)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from inference_engine.lora.grouped_matmul import lora_delta_reference, make_segments  # noqa: E402
from inference_engine.testing import run_under_triton_interpreter  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.mark.skipif(INTERPRETING, reason="the wrapper runs outside the interpreter")
def test_under_interpreter() -> None:
    out = run_under_triton_interpreter(__file__)
    assert "3 passed" in out, out


@interp
@pytest.mark.parametrize("slot_of", [
    [2, 2, -1, 0, 0, 0, -1, 2, 1, 1, 0],  # three slots and tokens with no adapter
    [1] * 7,  # one adapter for every token
    [0] * 37 + [2, -1],  # a prefill chunk longer than a row tile beside a decode
])
def test_grouped_kernel_equals_reference(slot_of: list[int]) -> None:
    from inference_engine.lora.triton_grouped_matmul import lora_delta_triton

    torch.manual_seed(0)
    # Sizes that are not multiples of the tiles; three fused parts with ranks below the
    # maximum, zero outside their blocks (what LoRALayerSlots.load_slot writes).
    slots, max_rank, k = 3, 8, 40
    rows = ((0, 32), (32, 48), (48, 64))
    ranks = [[8, 5, 0], [3, 3, 3], [0, 8, 1]]
    a = torch.zeros(slots, 3 * max_rank, k)
    b = torch.zeros(slots, 64, 3 * max_rank)
    for s in range(slots):
        for p, (n0, n1) in enumerate(rows):
            c = p * max_rank
            a[s, c:c + ranks[s][p]] = torch.randn(ranks[s][p], k)
            b[s, n0:n1, c:c + ranks[s][p]] = torch.randn(n1 - n0, ranks[s][p])
    seg = make_segments(slot_of, torch.device("cpu"), torch.float32)
    x = torch.randn(len(slot_of), k)
    out = torch.randn(len(slot_of), 64)
    expected = lora_delta_reference(x, a, b, seg, out.clone())
    got = lora_delta_triton(x, a, b, seg, out.clone())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
