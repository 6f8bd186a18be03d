"""Triton grouped GEMM over quantized experts: FP8 (block / per-row scales) and MXFP4.

The same grouping as the core's ``triton_moe``: the step's (token, slot)
assignments sorted by expert and padded on the device so that every
``BLOCK_SIZE_M`` rows share one expert (``align_block_size``, no host sync).
Each program multiplies one such row block by a ``BLOCK_SIZE_N`` slice of its
expert's weight, and the weight tile is decoded in registers inside the K loop,
so the experts stay quantized in memory and no dense copy of a layer is ever
made (weight-only: the activations stay in the compute dtype, as vLLM's
Triton/Marlin weight-only MoE paths do on GPUs without native low-bit math):

* ``fp8``: ``w [E, N, K]`` float8 with a float32 multiplier per ``(GROUP_N x
  GROUP_K)`` block, ``scale [E, ceil(N/GROUP_N), ceil(K/GROUP_K)]`` (DeepSeek
  128x128 blocks, or one row per output channel with ``GROUP_K = K``). The raw
  FP8 tile is converted to the activation dtype (exact) and the block scale is
  applied to the partial product of each K step, so ``BLOCK_SIZE_K`` divides
  ``GROUP_K``.
* ``mxfp4``: ``w [E, N, Kp/2]`` uint8 (two E2M1 codes per byte, low nibble
  first) with E8M0 bytes ``scale [E, N, Kp/32]``; every element is decoded
  and scaled before the dot.

Ground truth: :func:`inference_engine_quant.quant_moe.fused_moe_quant_reference`;
tested under ``TRITON_INTERPRET=1`` in float32.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from inference_engine.layers.moe.triton_moe import moe_block_rows, moe_store_block
except ImportError:  # pragma: no cover - triton is an optional extra
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "quant_grouped_gemm"]

HAS_TRITON = triton is not None

FORMAT_FP8 = 0
FORMAT_MXFP4 = 1


if HAS_TRITON:

    @triton.jit
    def _quant_grouped_gemm_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, bias_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
        num_padded_ptr, N, K, num_valid, max_padded,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk,
        stride_se, stride_sn, stride_sk, stride_cm, stride_cn, stride_bias_e,
        FORMAT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
        ROWS_PER_A: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        IEEE: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
        BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
    ):
        """``c[r] = (a[r // ROWS_PER_A] @ dequant(w[expert(r)])^T + bias) * rw[r]``."""
        rows, row_ok, expert, offs_n, n_ok = moe_block_rows(
            sorted_ids_ptr, block_expert_ptr, num_padded_ptr, N, num_valid, max_padded,
            BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = a_ptr + (rows[:, None] // ROWS_PER_A) * stride_am + offs_k[None, :] * stride_ak
        w_base = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
        s_base = s_ptr + expert * stride_se + (offs_n[None, :] // GROUP_N) * stride_sn
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for kb in range(0, (K + BLOCK_SIZE_K - 1) // BLOCK_SIZE_K):
            k_idx = kb * BLOCK_SIZE_K + offs_k
            k_ok = k_idx < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wk_mask = k_ok[:, None] & n_ok[None, :]
            if FORMAT == 0:
                # FP8: exact conversion to the activation dtype, block scale after the dot.
                w = tl.load(w_base + k_idx[:, None] * stride_wk, mask=wk_mask, other=0.0)
                w = w.to(a.dtype)
                if IEEE:
                    part = tl.dot(a, w, input_precision="ieee")
                else:
                    part = tl.dot(a, w)
                scale = tl.load(s_base + ((kb * BLOCK_SIZE_K) // GROUP_K) * stride_sk,
                                mask=n_ok[None, :], other=0.0)
                acc += part * scale
            else:
                # MXFP4: decode each E2M1 nibble and its block's E8M0 scale in registers.
                byte = tl.load(w_base + (k_idx[:, None] // 2) * stride_wk, mask=wk_mask,
                               other=0).to(tl.int32)
                code = (byte >> ((k_idx[:, None] % 2) * 4)) & 0xF
                exp = (code >> 1) & 3
                man = (code & 1).to(tl.float32)
                mag = tl.where(exp == 0, 0.5 * man,
                               tl.exp2((exp - 1).to(tl.float32)) * (1.0 + 0.5 * man))
                val = tl.where((code >> 3) == 1, -mag, mag)
                sb = tl.load(s_base + (k_idx[:, None] // 32) * stride_sk, mask=wk_mask,
                             other=127).to(tl.int32)
                w = (val * tl.exp2((sb - 127).to(tl.float32))).to(a.dtype)
                if IEEE:
                    acc = tl.dot(a, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_SIZE_K * stride_ak
        moe_store_block(acc, c_ptr, bias_ptr, weight_ptr, rows, row_ok, expert, offs_n, n_ok,
                        stride_cm, stride_cn, stride_bias_e, HAS_BIAS, MUL_WEIGHT)


def quant_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    group_nk: tuple[int, int],
    n: int,
    k: int,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    rows_per_a: int,
    config: dict[str, Any],
) -> None:
    """One grouped GEMM into ``c`` (rows in assignment order).

    Args:
        a: activations ``[rows / rows_per_a, k]`` (16/32-bit).
        w: ``[E, n, k]`` float8 (``fmt="fp8"``) or ``[E, n, kp/2]`` uint8 (``"mxfp4"``).
        scale: ``[E, ceil(n/gn), ceil(k/gk)]`` float32 (fp8) or ``[E, n, kp/32]`` uint8.
        group_nk: the FP8 scale block ``(gn, gk)``; ignored for MXFP4 (``(1, 32)``).
        bias: ``[E, n]`` or None; weights: ``[rows]`` float32 routing weights or None.
        sorted_ids, block_expert, num_padded: from ``align_block_size``.
        config: BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages.
    """
    if not HAS_TRITON:
        raise RuntimeError("the quantized fused-MoE kernel needs triton "
                           "(pip install 'inference-engine-quant[triton]')")
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"unknown quantized expert format {fmt!r}; expected 'fp8' or 'mxfp4'")
    gn, gk = (1, 32) if fmt == "mxfp4" else group_nk
    gk = min(gk, k) if gk >= k else gk
    block_k = int(config["BLOCK_SIZE_K"])
    if fmt == "fp8" and gk < k:
        while gk % block_k:  # each K step stays inside one scale block
            block_k //= 2
    if fmt == "fp8" and gk >= k:
        gk = max(k, block_k) * 2  # one scale block along all of K
    block_k = max(block_k, 16)
    max_padded = sorted_ids.shape[0]
    bm, bn = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"]
    grid = (triton.cdiv(max_padded, bm) * triton.cdiv(n, bn),)
    dummy = c
    _quant_grouped_gemm_kernel[grid](
        a, w, scale, c, bias if bias is not None else dummy,
        weights if weights is not None else dummy,
        sorted_ids, block_expert, num_padded, n, k, c.shape[0], max_padded,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0,
        FORMAT=FORMAT_FP8 if fmt == "fp8" else FORMAT_MXFP4, GROUP_N=gn, GROUP_K=gk,
        ROWS_PER_A=rows_per_a, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=block_k,
        GROUP_SIZE_M=config["GROUP_SIZE_M"], num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
