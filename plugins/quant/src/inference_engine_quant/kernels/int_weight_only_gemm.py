"""``y = x @ dequant(W)`` for 4/8-bit integer weights: a torch reference and a Triton kernel.

The runtime form every integer weight-only method (AWQ, GPTQ, compressed-tensors
``pack-quantized``) converts its checkpoint into:

* ``qweight [K/pack, N]`` int32: ``pack = 32/bits`` unsigned values along K per
  word, value ``j`` in bits ``j*bits ..`` (GPTQ's layout);
* ``scales [G, N]`` and ``zeros [G, N]`` float: the dequant multiplier and the
  (unsigned) zero point of group ``g``;
* ``g_idx [K]`` int32: the group of each input row (``k // group_size``, or
  GPTQ's act-order permutation).

``W[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``.

:func:`int_weight_only_reference` dequantizes K slices and multiplies (the
ground truth, and the path where no kernel is listed); :func:`int_weight_only_triton`
unpacks and scales inside the GEMM's K loop, activations staying 16/32-bit, and
is checked against the reference under ``TRITON_INTERPRET=1`` in float32.
Launch parameters come from ``inference_engine.kernel_tuning.tuning_config``
(op ``"int_weight_only_gemm"``, shape keys ``M N K``).
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

__all__ = [
    "DEFAULT_CONFIG",
    "HAS_TRITON",
    "dequantize_int_weight",
    "int_weight_only_reference",
    "int_weight_only_triton",
]

HAS_TRITON = triton is not None

# Elements of one dequantized K slice in the reference (4 MiB in float32).
_TILE_ELEMENTS = 1 << 20

DEFAULT_CONFIG: dict[str, Any] = {
    "BLOCK_SIZE_M": 16,
    "BLOCK_SIZE_N": 64,
    "BLOCK_SIZE_K": 64,
    "num_warps": 4,
    "num_stages": 2,
}


def dequantize_int_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          g_idx: torch.Tensor, bits: int, dtype: torch.dtype,
                          k_start: int = 0, k_stop: int | None = None) -> torch.Tensor:
    """Dense ``W[k_start:k_stop, :]`` in ``dtype`` (``k_start`` a multiple of the pack)."""
    pack = 32 // bits
    k = qweight.shape[0] * pack
    k_stop = k if k_stop is None else k_stop
    if k_start % pack:
        raise ValueError(f"k_start {k_start} is not a multiple of {pack}")
    words = qweight[k_start // pack: -(-k_stop // pack)]
    shifts = torch.arange(pack, dtype=torch.int32, device=qweight.device).view(1, pack, 1) * bits
    q = ((words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1, qweight.shape[1])
    q = q[: k_stop - k_start]
    groups = g_idx[k_start:k_stop].long()
    w = (q.float() - zeros.float()[groups]) * scales.float()[groups]
    return w.to(dtype)


def int_weight_only_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
    tile_k: int | None = None,
) -> torch.Tensor:
    """``x [T, K] @ W [K, N] (+ bias)`` with ``W`` dequantized ``tile_k`` rows at a time.

    The product is accumulated in float32 and returned in ``x.dtype``.
    """
    pack = 32 // bits
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"activations have {x.shape[-1]} columns, the layer expects {k}")
    compute = torch.float32 if x.dtype == torch.float32 else x.dtype
    if tile_k is None:
        tile_k = max(pack, _TILE_ELEMENTS // max(n, 1) // pack * pack)
    if tile_k >= k:
        y = (x.to(compute) @ dequantize_int_weight(qweight, scales, zeros, g_idx, bits,
                                                   compute)).float()
    else:
        y = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
        for k0 in range(0, k, tile_k):
            k1 = min(k, k0 + tile_k)
            w = dequantize_int_weight(qweight, scales, zeros, g_idx, bits, compute, k0, k1)
            y += (x[:, k0:k1].to(compute) @ w).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _int_weight_only_kernel(
        x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_wk, stride_wn, stride_sg, stride_sn, stride_ym, stride_yn,
        BITS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    ):
        """``y[m, n] = Σ_k x[m, k] · (q[k, n] - z[g[k], n]) · s[g[k], n] + bias[n]``."""
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            offs_k = k0 * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            kn_ok = k_ok[:, None] & n_ok[None, :]
            words = tl.load(w_ptr + (offs_k[:, None] // PACK) * stride_wk
                            + offs_n[None, :] * stride_wn, mask=kn_ok, other=0)
            q = (words >> ((offs_k[:, None] % PACK) * BITS)) & MASK
            g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            sz = g[:, None] * stride_sg + offs_n[None, :] * stride_sn
            s = tl.load(s_ptr + sz, mask=kn_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=kn_ok, other=0.0).to(tl.float32)
            w = ((q.to(tl.float32) - z) * s).to(x.dtype)  # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch_config(m: int, n: int, k: int, platform: Any) -> dict[str, Any]:
    default = dict(DEFAULT_CONFIG)
    if m > 16:
        default["BLOCK_SIZE_M"] = 64
    bucket = 1 << max(0, (max(m, 1) - 1).bit_length())
    try:
        from inference_engine.kernel_tuning import tuning_config
    except ImportError:  # pragma: no cover - older core without the tuning helper
        return default
    return tuning_config("int_weight_only_gemm", {"M": bucket, "N": n, "K": k}, default,
                         platform=platform)


def int_weight_only_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
    platform: Any = None,
) -> torch.Tensor:
    """Same contract as :func:`int_weight_only_reference`, in one Triton launch (any M).

    Raises:
        RuntimeError: when Triton is not installed.
    """
    if not HAS_TRITON:
        raise RuntimeError("int_weight_only_triton needs triton")
    pack = 32 // bits
    m, k = x.shape
    n = qweight.shape[1]
    if k != qweight.shape[0] * pack:
        raise ValueError(f"activations have {k} columns, the layer expects "
                         f"{qweight.shape[0] * pack}")
    if scales.stride() != zeros.stride():
        zeros = zeros.contiguous()
        scales = scales.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = config or _launch_config(m, n, k, platform)
    grid = (triton.cdiv(m, cfg["BLOCK_SIZE_M"]), triton.cdiv(n, cfg["BLOCK_SIZE_N"]))
    b = bias if bias is not None else y
    _int_weight_only_kernel[grid](
        x, qweight, scales, zeros, g_idx, b, y, m, n, k,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), y.stride(0), y.stride(1),
        BITS=bits, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"],
        BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y
