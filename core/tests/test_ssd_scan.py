"""Mamba-2's selective scan: the torch references against a plain per-token recurrence and
transformers' chunked scan, and the Triton kernels against the references.

The chunked SSD form and the one-step form must both equal the recurrence
``state = exp(dt A) state + dt x B^T; y = state C + D x`` token by token, over
sequences of several chunks and partial chunks, starting from a slot's state or
from zeros, with grouped B/C. ``triton.jit`` decides at import whether it
interprets, so the kernel cases run in a child pytest with ``TRITON_INTERPRET=1``
(float32).
"""

from __future__ import annotations

import os

import pytest
import torch
from inference_engine.layers.ssd_scan import (
    ssd_chunk_scan_one,
    ssd_chunk_scan_torch,
    ssm_decode_step_torch,
)
from inference_engine.testing import run_under_triton_interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child")

HEADS, GROUPS, P, N = 4, 2, 16, 16


def inputs(lengths: list[int], seed: int, num_slots: int = 5):
    """(x, dt, A, B, C, D, query_start_loc, ssm_state) for sequences of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = torch.randn(t, HEADS, P, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(t, HEADS, generator=gen) - 1.0)
    A = -torch.rand(HEADS, generator=gen) - 0.2
    B = torch.randn(t, GROUPS, N, generator=gen) * 0.5
    C = torch.randn(t, GROUPS, N, generator=gen) * 0.5
    D = torch.randn(HEADS, generator=gen)
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(lengths).cumsum(0)
    state = torch.randn(num_slots, HEADS, P, N, generator=gen)
    return x, dt, A, B, C, D, starts, state


def recurrence(x, dt, A, B, C, D, initial):
    """The spec, token by token: ``(y [L, H, P], final state [H, P, N])``."""
    rep = HEADS // GROUPS
    Bh, Ch = B.repeat_interleave(rep, 1), C.repeat_interleave(rep, 1)
    state = initial.clone() if initial is not None else torch.zeros(HEADS, P, N)
    ys = []
    for i in range(x.shape[0]):
        decay = torch.exp(dt[i] * A)[:, None, None]
        state = decay * state + (dt[i][:, None] * x[i])[:, :, None] * Bh[i][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, Ch[i]) + D[:, None] * x[i])
    return torch.stack(ys), state


@pytest.mark.parametrize("length, chunk", [(1, 16), (16, 16), (37, 16), (50, 8)])
def test_chunked_scan_equals_the_recurrence(length, chunk):
    x, dt, A, B, C, D, _, state = inputs([length], length)
    for initial in (None, state[1]):
        rep = HEADS // GROUPS
        y, final = ssd_chunk_scan_one(x, dt, A, B.repeat_interleave(rep, 1),
                                      C.repeat_interleave(rep, 1), chunk, initial)
        ref_y, ref_state = recurrence(x, dt, A, B, C, D, initial)
        torch.testing.assert_close(y + D[:, None] * x, ref_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, ref_state, atol=1e-4, rtol=1e-4)


def test_chunked_scan_equals_transformers_chunk_scan():
    """transformers' pure-torch ``mamba2_chunk_scan`` (Nemotron-H's prefill path)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    x, dt_raw, A, B, C, D, _, state = inputs([45], 7)
    dt_bias = torch.randn(HEADS)
    dt = torch.nn.functional.softplus(dt_raw + dt_bias)
    ref_y, ref_final = mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], 16, D=D,
                                         dt_bias=dt_bias, initial_states=state[2][None],
                                         dt_softplus=True, return_final_states=True)
    rep = HEADS // GROUPS
    y, final = ssd_chunk_scan_one(x, dt, A, B.repeat_interleave(rep, 1),
                                  C.repeat_interleave(rep, 1), 16, state[2])
    torch.testing.assert_close(y + D[:, None] * x, ref_y[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_final[0], atol=1e-4, rtol=1e-4)


def test_varlen_scan_reads_and_writes_each_slot():
    lengths = [5, 40, 17]
    x, dt, A, B, C, D, starts, state = inputs(lengths, 3)
    slots = torch.tensor([4, 0, 2])
    has_initial = torch.tensor([True, False, True])
    before = state.clone()
    y = ssd_chunk_scan_torch(x, dt, A, B, C, D, 16, starts, has_initial, state, slots)
    for i, (s, e) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)):
        initial = before[slots[i]] if has_initial[i] else None
        ref_y, ref_state = recurrence(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, initial)
        torch.testing.assert_close(y[s:e], ref_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[slots[i]], ref_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[[1, 3]], before[[1, 3]], atol=0, rtol=0)  # untouched


def test_decode_step_equals_one_recurrence_step():
    x, dt, A, B, C, D, _, state = inputs([3], 4)
    slots = torch.tensor([3, 1, 4])
    before = state.clone()
    y = ssm_decode_step_torch(x, dt, A, B, C, D, state, slots)
    for i in range(3):
        ref_y, ref_state = recurrence(x[i : i + 1], dt[i : i + 1], A, B[i : i + 1],
                                      C[i : i + 1], D, before[slots[i]])
        torch.testing.assert_close(y[i], ref_y[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slots[i]], ref_state, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Triton kernels (in the interpreter child).
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(INTERPRETING, reason="this is the wrapper; the cases run in the child")
def test_kernel_cases_under_the_interpreter():
    pytest.importorskip("triton")
    stdout = run_under_triton_interpreter(__file__)
    assert "passed" in stdout and "failed" not in stdout, stdout[-2000:]


@interp
@pytest.mark.parametrize("chunk", [16, 32])
def test_triton_scan_equals_reference(chunk):
    from inference_engine.layers.triton_ssd_scan import ssd_chunk_scan_triton

    lengths = [3, 40, 16, 21]
    x, dt, A, B, C, D, starts, state = inputs(lengths, 5, num_slots=6)
    slots = torch.tensor([5, 0, 2, 3])
    has_initial = torch.tensor([True, False, True, True])
    ref_state, got_state = state.clone(), state.clone()
    ref = ssd_chunk_scan_torch(x, dt, A, B, C, D, chunk, starts, has_initial, ref_state, slots)
    got = ssd_chunk_scan_triton(x, dt, A, B, C, D, chunk, starts, has_initial, got_state, slots)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, ref_state, atol=1e-4, rtol=1e-4)


@interp
def test_triton_decode_step_equals_reference():
    from inference_engine.layers.triton_ssd_scan import ssm_decode_step_triton

    x, dt, A, B, C, D, _, state = inputs([4], 6)
    slots = torch.tensor([2, 0, 4, 1])
    ref_state, got_state = state.clone(), state.clone()
    ref = ssm_decode_step_torch(x, dt, A, B, C, D, ref_state, slots)
    got = ssm_decode_step_triton(x, dt, A, B, C, D, got_state, slots)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernels_on_gpu_equal_the_reference():
    """The compiled kernels on a real chunk size (64) and head size (64), float32 state,
    bf16 activations (upcast in the kernels) against the torch references on the same device."""
    from inference_engine.layers.triton_ssd_scan import (
        ssd_chunk_scan_triton,
        ssm_decode_step_triton,
    )

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(9)
    lengths, heads, groups, p, n = [1, 200, 64, 77], 8, 2, 64, 64
    t = sum(lengths)
    x = torch.randn(t, heads, p, generator=gen).to(cuda, torch.bfloat16)
    dt = torch.nn.functional.softplus(torch.randn(t, heads, generator=gen) - 1.0).to(cuda)
    A = (-torch.rand(heads, generator=gen) - 0.2).to(cuda)
    B = (torch.randn(t, groups, n, generator=gen) * 0.5).to(cuda, torch.bfloat16)
    C = (torch.randn(t, groups, n, generator=gen) * 0.5).to(cuda, torch.bfloat16)
    D = torch.randn(heads, generator=gen).to(cuda)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=cuda)
    state = torch.randn(6, heads, p, n, generator=gen).to(cuda)
    slots = torch.tensor([5, 0, 2, 3], device=cuda)
    has_initial = torch.tensor([True, False, True, True], device=cuda)
    ref_state, got_state = state.clone(), state.clone()
    ref = ssd_chunk_scan_torch(x, dt, A, B, C, D, 64, starts, has_initial, ref_state, slots)
    got = ssd_chunk_scan_triton(x, dt, A, B, C, D, 64, starts, has_initial, got_state, slots)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_state, ref_state, atol=2e-3, rtol=2e-3)
    ref = ssm_decode_step_torch(x[:4], dt[:4], A, B[:4], C[:4], D, ref_state, slots)
    got = ssm_decode_step_triton(x[:4], dt[:4], A, B[:4], C[:4], D, got_state, slots)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_state, ref_state, atol=2e-3, rtol=2e-3)
