"""Triton kernels for Mamba-2's chunked SSD scan and one-step decode over the state pool.

Same signatures and results as :mod:`.ssd_scan`'s torch references (tested against
them under ``TRITON_INTERPRET=1`` in float32).

Scan: one program per (sequence, head, block of ``P`` channels); it walks the
sequence a chunk at a time, holding the ``[BLOCK_P, N]`` state in registers:
inside a chunk ``y = ((C B^T) * decay) (x dt) + exp(cum) * (C state^T)``, then
``state = exp(cum_last) * state + (x dt * exp(cum_last - cum))^T B``. Positions past
the sequence load ``dt = 0`` and so neither decay nor feed the state. Decode: one
program per (sequence, head, block of ``P``), the recurrence on a ``[BLOCK_P, N]`` tile.
Matmuls use IEEE float32 (no TF32): the state accumulates over the whole context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ssd_chunk_scan_triton", "ssm_decode_step_triton"]


@triton.jit
def _ssd_chunk_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, state_ptr,
    starts_ptr, slots_ptr, init_ptr,
    stride_x_t, stride_x_h, stride_dt_t, stride_b_t, stride_b_g, stride_c_t, stride_c_g,
    stride_y_t, stride_y_h, stride_s_slot, stride_s_h, stride_s_p,
    heads_per_group, head_dim, state_size,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    start = tl.load(starts_ptr + seq)
    end = tl.load(starts_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has_init = tl.load(init_ptr + seq)
    g = h // heads_per_group
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, CHUNK)
    mask_p = offs_p < head_dim
    mask_n = offs_n < state_size
    mask_pn = mask_p[:, None] & mask_n[None, :]
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    s_ptrs = (state_ptr + slot * stride_s_slot + h * stride_s_h
              + offs_p[:, None] * stride_s_p + offs_n[None, :])
    state = tl.load(s_ptrs, mask=mask_pn, other=0.0).to(tl.float32)
    state = tl.where(has_init != 0, state, 0.0)  # [BLOCK_P, BLOCK_N]
    causal = offs_l[:, None] >= offs_l[None, :]
    for c0 in range(start, end, CHUNK):
        t = (c0 + offs_l).to(tl.int64)
        mask_t = t < end
        mask_tp = mask_t[:, None] & mask_p[None, :]
        mask_tn = mask_t[:, None] & mask_n[None, :]
        x = tl.load(x_ptr + t[:, None] * stride_x_t + h * stride_x_h + offs_p[None, :],
                    mask=mask_tp, other=0.0).to(tl.float32)  # [L, BLOCK_P]
        dt = tl.load(dt_ptr + t * stride_dt_t + h, mask=mask_t, other=0.0).to(tl.float32)
        bm = tl.load(b_ptr + t[:, None] * stride_b_t + g * stride_b_g + offs_n[None, :],
                     mask=mask_tn, other=0.0).to(tl.float32)  # [L, BLOCK_N]
        cm = tl.load(c_ptr + t[:, None] * stride_c_t + g * stride_c_g + offs_n[None, :],
                     mask=mask_tn, other=0.0).to(tl.float32)
        cum = tl.cumsum(dt * a, axis=0)  # [L]
        xdt = x * dt[:, None]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        scores = tl.dot(cm, tl.trans(bm), input_precision="ieee") * decay  # [L, L]
        y = tl.dot(scores, xdt, input_precision="ieee")
        y += tl.dot(cm, tl.trans(state), input_precision="ieee") * tl.exp(cum)[:, None]
        y += d * x
        tl.store(y_ptr + t[:, None] * stride_y_t + h * stride_y_h + offs_p[None, :], y,
                 mask=mask_tp)
        last = tl.sum(tl.where(offs_l == CHUNK - 1, cum, 0.0), axis=0)
        weighted = xdt * tl.exp(last - cum)[:, None]  # [L, BLOCK_P]
        state = state * tl.exp(last) + tl.dot(tl.trans(weighted), bm, input_precision="ieee")
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_pn)


@triton.jit
def _ssm_decode_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, state_ptr, slots_ptr,
    stride_x_t, stride_x_h, stride_dt_t, stride_b_t, stride_b_g, stride_c_t, stride_c_g,
    stride_y_t, stride_y_h, stride_s_slot, stride_s_h, stride_s_p,
    heads_per_group, head_dim, state_size,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
) -> None:
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    g = h // heads_per_group
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < state_size
    mask_pn = mask_p[:, None] & mask_n[None, :]
    s_ptrs = (state_ptr + slot * stride_s_slot + h * stride_s_h
              + offs_p[:, None] * stride_s_p + offs_n[None, :])
    state = tl.load(s_ptrs, mask=mask_pn, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + i * stride_x_t + h * stride_x_h + offs_p, mask=mask_p,
                other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + i * stride_dt_t + h).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    bv = tl.load(b_ptr + i * stride_b_t + g * stride_b_g + offs_n, mask=mask_n,
                 other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + i * stride_c_t + g * stride_c_g + offs_n, mask=mask_n,
                 other=0.0).to(tl.float32)
    state = state * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_pn)
    y = tl.sum(state * cv[None, :], axis=1) + d * x
    tl.store(y_ptr + i * stride_y_t + h * stride_y_h + offs_p, y, mask=mask_p)


def _block_p(head_dim: int) -> int:
    return min(64, max(16, triton.next_power_of_2(head_dim)))


def ssd_chunk_scan_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          C: torch.Tensor, D: torch.Tensor, chunk_size: int,
                          query_start_loc: torch.Tensor, has_initial: torch.Tensor,
                          ssm_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """:func:`~inference_engine.layers.ssd_scan.ssd_chunk_scan_torch` in one launch.

    ``chunk_size`` must be a power of two of at least 16 (``tl.dot``'s smallest tile).
    """
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"the Triton SSD scan needs a power-of-two chunk_size >= 16, "
                         f"got {chunk_size}")
    t, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    B = B if B.stride(-1) == 1 else B.contiguous()
    C = C if C.stride(-1) == 1 else C.contiguous()
    y = torch.empty((t, heads, head_dim), dtype=torch.float32, device=x.device)
    num_seqs = query_start_loc.shape[0] - 1
    block_p = _block_p(head_dim)
    grid = (num_seqs, heads, triton.cdiv(head_dim, block_p))
    _ssd_chunk_scan_kernel[grid](
        x, dt, A, B, C, D, y, ssm_state, query_start_loc, slots, has_initial.to(torch.int32),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), y.stride(0), y.stride(1), ssm_state.stride(0), ssm_state.stride(1),
        ssm_state.stride(2), heads // groups, head_dim, state_size,
        CHUNK=chunk_size, BLOCK_P=block_p,
        BLOCK_N=max(16, triton.next_power_of_2(state_size)),
    )
    return y


def ssm_decode_step_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor, ssm_state: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """:func:`~inference_engine.layers.ssd_scan.ssm_decode_step_torch` in one launch."""
    n, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    B = B if B.stride(-1) == 1 else B.contiguous()
    C = C if C.stride(-1) == 1 else C.contiguous()
    y = torch.empty((n, heads, head_dim), dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    block_p = _block_p(head_dim)
    grid = (n, heads, triton.cdiv(head_dim, block_p))
    _ssm_decode_kernel[grid](
        x, dt, A, B, C, D, y, ssm_state, slots,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), y.stride(0), y.stride(1), ssm_state.stride(0), ssm_state.stride(1),
        ssm_state.stride(2), heads // groups, head_dim, state_size,
        BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(state_size)),
    )
    return y
