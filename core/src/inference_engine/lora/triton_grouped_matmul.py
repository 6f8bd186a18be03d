"""The grouped LoRA shrink and expand as Triton kernels (punica's SGMV shape).

The step's tokens are laid out slot by slot (``token_order``: the rows of each
segment of :class:`~inference_engine.lora.grouped_matmul.StepSegments` one after
another, ``segment_starts`` where each begins); a program multiplies a
``BLOCK_M``-row tile of one segment by a tile of that segment's slot with
``tl.dot``, gathering and scattering rows through ``token_order``, so one
launch covers every adapter of the step. The torch reference is
:mod:`~inference_engine.lora.grouped_matmul`; the two agree in float32 under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_engine.lora.grouped_matmul import StepSegments

__all__ = ["lora_delta_triton", "segment_tensors"]


def segment_tensors(seg: StepSegments, num_tokens: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(token_order [rows], segment_starts [G + 1], segment_slots [G], longest segment)``
    of ``seg`` (int32 on ``device``)."""
    order = (torch.arange(num_tokens, device=device) if seg.order is None else seg.order)
    return (order.to(torch.int32), torch.tensor(seg.starts, dtype=torch.int32, device=device),
            torch.tensor(seg.slots, dtype=torch.int32, device=device), seg.longest)


@triton.jit
def _segment_matmul(src, weights, dst, order, starts, slots,
                    K, N, src_stride, w_stride_slot, w_stride_n, dst_stride,
                    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """``dst[order[rows]] (+)= src[order[rows]] @ weights[slot]^T`` for one tile of one
    segment; ``weights [slots, N, K]``."""
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    begin = tl.load(starts + seg)
    end = tl.load(starts + seg + 1)
    slot = tl.load(slots + seg).to(tl.int64)
    offs_m = begin + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < end
    if pid_m * BLOCK_M >= end - begin:
        return
    tokens = tl.load(order + offs_m, mask=row_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(src + tokens[:, None] * src_stride + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(weights + slot * w_stride_slot + offs_n[None, :] * w_stride_n
                    + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
    out_ptr = dst + tokens[:, None] * dst_stride + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr, acc.to(dst.dtype.element_ty), mask=mask)


def _launch(src: torch.Tensor, weights: torch.Tensor, dst: torch.Tensor,
            seg: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], accumulate: bool) -> None:
    order, starts, slots, longest = seg
    _, n, k = weights.shape
    block_m, block_n, block_k = 16, 32, 32
    grid = (slots.numel(), triton.cdiv(longest, block_m), triton.cdiv(n, block_n))
    _segment_matmul[grid](src, weights, dst, order, starts, slots, k, n, src.stride(0),
                          weights.stride(0), weights.stride(1), dst.stride(0),
                          ACCUMULATE=accumulate, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_K=block_k)


def lora_delta_triton(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      seg: StepSegments, out: torch.Tensor) -> torch.Tensor:
    """``out[tokens of a segment] += x[tokens] A^T B^T`` of the segment's slot, in place: one
    shrink launch into a float32 ``[T, P*R]`` buffer, one expand launch over the whole
    (part-blocked) ``B``; returns ``out``.

    ``x [T, K]`` and ``out [T, N]`` must have unit stride along their last dimension.
    """
    tensors = segment_tensors(seg, x.shape[0], x.device)
    shrunk = torch.zeros(x.shape[0], lora_a.shape[1], device=x.device, dtype=torch.float32)
    _launch(x, lora_a.contiguous(), shrunk, tensors, accumulate=False)
    _launch(shrunk, lora_b.contiguous(), out, tensors, accumulate=True)
    return out
