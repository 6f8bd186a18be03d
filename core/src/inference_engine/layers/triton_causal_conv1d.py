"""Triton kernel of the causal depthwise conv's one-token update (Mamba-2 decode).

Same contract as :func:`~inference_engine.layers.causal_conv1d.causal_conv1d_update_torch`:
one program per (sequence, block of channels) reads the slot's window, appends the new
input, writes the conv output and the shifted window back. Accumulates in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_conv1d_update_triton"]


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, b_ptr, out_ptr, slots_ptr,
    stride_x_n, stride_s_slot, stride_s_d, stride_s_k, stride_w_d, stride_o_n, dim,
    KERNEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
) -> None:
    i = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    mask_d = offs_d < dim
    keep = KERNEL - 1
    s_base = state_ptr + slot * stride_s_slot + offs_d[:, None] * stride_s_d
    # The new input, rounded to the state's dtype as it is stored.
    x = tl.load(x_ptr + i * stride_x_n + offs_d, mask=mask_d, other=0.0)
    x = x.to(state_ptr.dtype.element_ty)
    # window [BLOCK_D, BLOCK_K]: the kept inputs in columns 0..keep-1, the new one at keep.
    window = tl.load(s_base + offs_k[None, :] * stride_s_k,
                     mask=mask_d[:, None] & (offs_k[None, :] < keep), other=0.0)
    window = tl.where(offs_k[None, :] == keep, x[:, None], window)
    w = tl.load(w_ptr + offs_d[:, None] * stride_w_d + offs_k[None, :],
                mask=mask_d[:, None] & (offs_k[None, :] < KERNEL), other=0.0)
    out = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    tl.store(out_ptr + i * stride_o_n + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)
    # The window shifted by one: column k takes column k + 1 (the last kept one, the input).
    shifted = tl.load(s_base + (offs_k[None, :] + 1) * stride_s_k,
                      mask=mask_d[:, None] & (offs_k[None, :] + 1 < keep), other=0.0)
    shifted = tl.where(offs_k[None, :] + 1 == keep, x[:, None], shifted)
    tl.store(s_base + offs_k[None, :] * stride_s_k, shifted,
             mask=mask_d[:, None] & (offs_k[None, :] < keep))


def causal_conv1d_update_triton(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`~inference_engine.layers.causal_conv1d.causal_conv1d_update_torch` in one
    launch (float32 accumulation)."""
    n, dim = x.shape
    kernel = weight.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((n, dim), dtype=weight.dtype, device=x.device)
    if n == 0:
        return out
    block_d = min(256, triton.next_power_of_2(dim))
    grid = (n, triton.cdiv(dim, block_d))
    _causal_conv1d_update_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, out, slots,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), out.stride(0), dim,
        KERNEL=kernel, BLOCK_K=triton.next_power_of_2(kernel), BLOCK_D=block_d,
        HAS_BIAS=bias is not None,
    )
    return out
