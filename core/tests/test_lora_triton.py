"""The Triton grouped LoRA kernels against the torch reference, in float32 under
``TRITON_INTERPRET=1`` (a child pytest: ``triton.jit`` decides at import whether it
interprets)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from inference_engine.lora.grouped_matmul import TokenGroup, lora_expand, lora_shrink  # noqa: E402
from inference_engine.testing import run_under_triton_interpreter  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.mark.skipif(INTERPRETING, reason="the wrapper runs outside the interpreter")
def test_under_interpreter() -> None:
    out = run_under_triton_interpreter(__file__)
    assert "3 passed" in out, out


def reference(x, a, b, groups, out):
    return lora_expand(lora_shrink(x, a, groups), b, groups, out.clone())


@interp
@pytest.mark.parametrize("layout", ["mixed", "one_adapter_all_tokens", "long_segment"])
def test_grouped_kernel_equals_reference(layout: str) -> None:
    from inference_engine.lora.triton_grouped_matmul import lora_delta_triton

    torch.manual_seed(0)
    slots, rank, k, n = 3, 24, 40, 72  # ranks / sizes that are not multiples of the tiles
    a = torch.randn(slots, rank, k)
    b = torch.randn(slots, n, rank)
    if layout == "mixed":
        slot_of = [2, 2, -1, 0, 0, 0, -1, 2, 1, 1, 0]
        groups = [TokenGroup(s, torch.tensor([t for t, v in enumerate(slot_of) if v == s]))
                  for s in range(slots)]
    elif layout == "one_adapter_all_tokens":
        slot_of = [1] * 7
        groups = [TokenGroup(1, None)]
    else:  # a prefill chunk longer than one row tile next to two decodes
        slot_of = [0] * 37 + [2, -1]
        groups = [TokenGroup(0, torch.arange(37)), TokenGroup(2, torch.tensor([37]))]
    x = torch.randn(len(slot_of), k)
    out = torch.randn(len(slot_of), n)
    expected = reference(x, a, b, groups, out)
    got = lora_delta_triton(x, a, b, groups, out.clone())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
