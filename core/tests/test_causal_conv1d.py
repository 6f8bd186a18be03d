"""The causal depthwise conv's one-token update (Mamba-2 decode): the torch reference against
``torch.nn.functional.conv1d`` over the whole sequence, the Triton kernel against the
reference (in a child pytest with ``TRITON_INTERPRET=1``, float32, as for the SSD scan).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from inference_engine.layers.causal_conv1d import causal_conv1d_update_torch
from inference_engine.testing import run_under_triton_interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")


def weights(dim: int, kernel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(dim, kernel, generator=gen), torch.randn(dim, generator=gen)


@pytest.mark.parametrize("kernel, use_bias", [(4, True), (3, False)])
def test_token_by_token_updates_equal_the_causal_conv_of_the_sequence(kernel, use_bias):
    dim, length = 24, 11
    weight, bias = weights(dim, kernel, 1)
    bias = bias if use_bias else None
    seq = torch.randn(length, dim, generator=torch.Generator().manual_seed(2))
    state = torch.randn(3, dim, kernel - 1)
    state[1] = 0  # a fresh sequence: zeros before its first input
    outs = [causal_conv1d_update_torch(seq[t : t + 1], state, torch.tensor([1]), weight, bias)
            for t in range(length)]
    ref = F.conv1d(F.pad(seq.t()[None], (kernel - 1, 0)), weight[:, None, :], bias,
                   groups=dim)[0].t()
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], seq[-(kernel - 1):].t())  # the last inputs kept


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "passed" in stdout and "failed" not in stdout, stdout[-2000:]


@interp
@pytest.mark.parametrize("dim, kernel, use_bias", [(40, 4, True), (300, 4, False),
                                                    (24, 3, True)])
def test_triton_update_equals_reference(dim, kernel, use_bias):
    from inference_engine.layers.triton_causal_conv1d import causal_conv1d_update_triton

    gen = torch.Generator().manual_seed(dim)
    weight, bias = weights(dim, kernel, dim)
    bias = bias if use_bias else None
    # The new inputs are a column slice of a wider projection, as in the mixer.
    x = torch.randn(3, dim + 8, generator=gen)[:, 4 : 4 + dim]
    state = torch.randn(5, dim, kernel - 1, generator=gen)
    slots = torch.tensor([4, 0, 2])
    ref_state, got_state = state.clone(), state.clone()
    ref = causal_conv1d_update_torch(x, ref_state, slots, weight, bias)
    got = causal_conv1d_update_triton(x, got_state, slots, weight, bias)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, ref_state, atol=0, rtol=0)


def test_the_platform_answer_picks_the_kernel():
    from inference_engine.layers.causal_conv1d import choose_conv_update

    assert choose_conv_update("cpu") is causal_conv1d_update_torch
    assert choose_conv_update("torch") is causal_conv1d_update_torch
    pytest.importorskip("triton")
    from inference_engine.layers.triton_causal_conv1d import causal_conv1d_update_triton

    assert choose_conv_update("triton") is causal_conv1d_update_triton


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_on_gpu_equals_the_float32_reference():
    """bf16 inputs, state and weights (a bf16 model's), a real width (Nemotron-H's conv_dim
    of 1024 + 2 * 4 * 64), against the reference run on float32 copies of the same values."""
    from inference_engine.layers.triton_causal_conv1d import causal_conv1d_update_triton

    cuda = torch.device("cuda")
    dim, kernel = 1536, 4
    weight, bias = (t.to(cuda, torch.bfloat16) for t in weights(dim, kernel, 5))
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, dim, generator=gen).to(cuda, torch.bfloat16)
    state = torch.randn(12, dim, kernel - 1, generator=gen).to(cuda, torch.bfloat16)
    slots = torch.tensor([11, 0, 3, 4, 7, 1, 9, 2], device=cuda)
    ref_state = state.float()
    ref = causal_conv1d_update_torch(x.float(), ref_state, slots, weight.float(), bias.float())
    got = causal_conv1d_update_triton(x, state, slots, weight, bias)
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(state.float(), ref_state, atol=0, rtol=0)
