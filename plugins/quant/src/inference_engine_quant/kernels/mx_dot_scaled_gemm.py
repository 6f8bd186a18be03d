"""MX weights through ``tl.dot_scaled``: the native block-scaled GEMM of sm100+ GPUs.

``y = x @ W^T`` with ``W`` MXFP4 (packed E2M1 ``[N, Kp/2]``, low nibble first, the
layout :mod:`fp4_gemm` reads) or MXFP8 (E4M3 ``[N, Kp]``, any strides: the engine
holds MXFP8 weights as ``[Kp, N]`` and passes the transposed view), with E8M0
scales ``[N, Kp/32]``. Two activation forms:

* ``"e4m3"``: ``x`` quantized to MXFP8 per call (E4M3 values with an E8M0
  scale per 32, :func:`~inference_engine_quant.mx_block.quantize_mxfp8`), so
  both operands are microscaled and Blackwell's tensor cores (``kind::mxf8f6f4``)
  run the product natively;
* ``"bf16"``: 16-bit activations, the weight decoded by ``dot_scaled`` itself
  (Triton emulates it by upcasting where the hardware has no native path).

Chosen only where the platform lists ``KERNEL_TRITON_MXFP4`` (Triton's ``dot_scaled``
MX GEMM) in its
``fp4_gemm_kernels()`` (CUDA sm100+, ROCm gfx950). Checked against the
dequantize-then-matmul reference under ``TRITON_INTERPRET=1`` (the interpreter
emulates ``dot_scaled``); its speed on a Blackwell GPU is not measured.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional extra
    triton = None
    tl = None

__all__ = ["DEFAULT_CONFIG", "HAS_TRITON", "mx_dot_scaled_linear", "mxfp4_dot_scaled_linear"]

HAS_TRITON = triton is not None

DEFAULT_CONFIG: dict[str, Any] = {
    "BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "num_warps": 4,
    "num_stages": 3,
}

if HAS_TRITON:

    @triton.jit
    def _mx_dot_scaled_kernel(
        x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr,
        M, N, KP,
        stride_xm, stride_xk, stride_xsm, stride_xsk, stride_wn, stride_wk, stride_wsn,
        stride_wsk, stride_ym, stride_yn,
        LHS_FORMAT: tl.constexpr, RHS_FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    ):
        """``y[m, n] = Σ_k x[m, k]·xs[m, k/32] · e2m1(w[n, k])·2^(ws[n, k/32]-127) + bias[n]``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k0 in range(0, (KP + BLOCK_SIZE_K - 1) // BLOCK_SIZE_K):
            offs_k = k0 * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
            offs_kb = k0 * (BLOCK_SIZE_K // 2) + tl.arange(0, BLOCK_SIZE_K // 2)
            offs_ks = k0 * (BLOCK_SIZE_K // 32) + tl.arange(0, BLOCK_SIZE_K // 32)
            k_ok = offs_k < KP
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if RHS_FORMAT == "e2m1":
                # Packed weight as dot_scaled's rhs [K/2, N] (K packed), scales [N, K/32].
                w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_kb[:, None] * stride_wk,
                            mask=(offs_kb[:, None] < KP // 2) & n_ok[None, :], other=0)
            else:
                w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                            mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            ws = tl.load(ws_ptr + offs_n[:, None] * stride_wsn + offs_ks[None, :] * stride_wsk,
                         mask=n_ok[:, None] & (offs_ks[None, :] < KP // 32), other=127)
            if LHS_FORMAT == "e4m3":
                xs = tl.load(xs_ptr + offs_m[:, None] * stride_xsm
                             + offs_ks[None, :] * stride_xsk,
                             mask=m_ok[:, None] & (offs_ks[None, :] < KP // 32), other=127)
                acc = tl.dot_scaled(x, xs, "e4m3", w, ws, RHS_FORMAT, acc)
            else:
                acc = tl.dot_scaled(x, None, LHS_FORMAT, w, ws, RHS_FORMAT, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def mxfp4_dot_scaled_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    input_size: int,
    bias: torch.Tensor | None = None,
    activations: str = "e4m3",
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """MXFP4 weights (``packed [N, Kp/2]`` uint8, ``scales [N, Kp/32]``): see
    :func:`mx_dot_scaled_linear`."""
    return mx_dot_scaled_linear(x, packed, scales, input_size, "e2m1", bias, activations,
                                config)


def mx_dot_scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    input_size: int,
    weight_format: str = "e2m1",
    bias: torch.Tensor | None = None,
    activations: str = "e4m3",
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``x [..., K] @ dequant(W)^T (+ bias)`` through ``tl.dot_scaled``, in ``x.dtype``.

    Args:
        weight: ``[N, Kp/2]`` uint8 E2M1 (``weight_format="e2m1"``) or ``[N, Kp]``
            float8_e4m3fn (``"e4m3"``, any strides); scales: ``[N, Kp/32]`` E8M0 bytes.
        activations: ``"e4m3"`` (quantize ``x`` to MXFP8 per call: native on sm100+) or
            ``"bf16"`` (16-bit activations).

    Raises:
        RuntimeError: triton is not installed. ValueError: bad shapes or format.
    """
    from inference_engine_quant.mx_block import pad_to_block, quantize_mxfp8

    if not HAS_TRITON:
        raise RuntimeError("mxfp4_dot_scaled_linear needs triton")
    if activations not in ("e4m3", "bf16"):
        raise ValueError(f"activations must be 'e4m3' or 'bf16', got {activations!r}")
    if weight_format not in ("e2m1", "e4m3"):
        raise ValueError(f"weight_format must be 'e2m1' or 'e4m3', got {weight_format!r}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    packed = weight
    n = weight.shape[0]
    kp = weight.shape[1] * 2 if weight_format == "e2m1" else weight.shape[1]
    if k != input_size or kp < k or kp % 32:
        raise ValueError(f"activations have {k} columns; the layer expects {input_size} "
                         f"(packed K {kp}, a multiple of 32)")
    cfg = dict(DEFAULT_CONFIG if config is None else config)
    if activations == "e4m3":
        xq, xs = quantize_mxfp8(x2)
        xq, xs = xq.contiguous(), xs.view(torch.uint8).contiguous()
    else:
        xq, xs = pad_to_block(x2, 32).to(torch.bfloat16).contiguous(), None
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    scales_u8 = scales.view(torch.uint8)
    xs_arg = xs if xs is not None else scales_u8
    grid = (triton.cdiv(m, cfg["BLOCK_SIZE_M"]), triton.cdiv(n, cfg["BLOCK_SIZE_N"]))
    _mx_dot_scaled_kernel[grid](
        xq, xs_arg, packed, scales_u8, bias if bias is not None else y, y, m, n, kp,
        xq.stride(0), xq.stride(1), xs_arg.stride(0), xs_arg.stride(1),
        packed.stride(0), packed.stride(1), scales_u8.stride(0), scales_u8.stride(1),
        y.stride(0), y.stride(1),
        LHS_FORMAT=activations, RHS_FORMAT=weight_format, HAS_BIAS=bias is not None,
        BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"],
        BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y.reshape(*lead, n)
