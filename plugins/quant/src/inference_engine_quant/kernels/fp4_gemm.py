"""``y = x @ dequant(W)^T`` for packed FP4 weights: a tiled PyTorch reference and a Triton kernel.

The weight stays packed in memory: ``packed [N, Kp/2]`` uint8 (two E2M1 codes
per byte, low nibble first) with one scale per ``GROUP`` elements along K:

* MXFP4: ``GROUP = 32``, E8M0 bytes (``2^(b-127)``);
* NVFP4: ``GROUP = 16``, FP8 E4M3 bytes, times a float32 global scale per
  output row (ModelOpt's ``weight_scale_2``; per row so fused q/k/v keep their own).

:func:`fp4_linear_reference` dequantizes a tile of output rows at a time into
the activation dtype and multiplies, so no full dense copy ever exists; it
is the ground truth and the CPU path. :func:`fp4_linear_triton` decodes the
nibbles and scales inside the GEMM's K loop (weight-only: activations stay
16/32-bit, as vLLM's Triton/Marlin FP4 paths do on GPUs without FP4 math) and
is checked against the reference under ``TRITON_INTERPRET=1`` in float32. At
decode sizes (few row tiles) K is split over programs (``SPLIT_K``, from the
tuning table or ``auto_split_k``) so the packed weights stream from every SM;
the float32 partials are summed in a fixed order.
Launch parameters come from ``inference_engine.kernel_tuning.tuning_config``
(op ``"fp4_gemm"``, shape keys ``M N K``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from inference_engine_quant.kernels.fp8_block_gemm import auto_split_k
from inference_engine_quant.mx_e2m1 import _PAIR_LUT
from inference_engine_quant.mx_e8m0 import decode_e8m0

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional extra
    triton = None
    tl = None

__all__ = [
    "DEFAULT_CONFIG",
    "HAS_TRITON",
    "ScaleKind",
    "dequantize_fp4_rows",
    "fp4_linear_reference",
    "fp4_linear_triton",
]

HAS_TRITON = triton is not None

ScaleKind = Literal["e8m0", "e4m3"]

# Elements of one dequantized tile in the reference (4 MiB in float32).
_TILE_ELEMENTS = 1 << 20

# E8M0 byte -> float32 scale, shaped for F.embedding.
_E8M0_LUT = decode_e8m0(torch.arange(256, dtype=torch.uint8)).unsqueeze(1)

DEFAULT_CONFIG: dict[str, Any] = {
    "SPLIT_K": 0,  # 0: choose by auto_split_k
    "BLOCK_SIZE_M": 16,
    "BLOCK_SIZE_N": 64,
    "BLOCK_SIZE_K": 64,
    "num_warps": 4,
    "num_stages": 2,
}


def _group_of(scale_kind: ScaleKind) -> int:
    if scale_kind == "e8m0":
        return 32
    if scale_kind == "e4m3":
        return 16
    raise ValueError(f"unknown FP4 scale kind {scale_kind!r}; expected 'e8m0' or 'e4m3'")


def dequantize_fp4_rows(
    packed: torch.Tensor,
    scales: torch.Tensor,
    scale_kind: ScaleKind,
    global_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dense ``[rows, Kp]`` in ``dtype`` from packed rows, their scales and optional row globals."""
    group = _group_of(scale_kind)
    rows = packed.shape[0]
    # One table lookup per byte (int32 indices, no int64 copy), then the scale in place.
    values = F.embedding(packed.int(), _PAIR_LUT.to(packed.device))  # [rows, Kp/2, 2]
    values = values.view(rows, -1, group)
    if scale_kind == "e8m0":
        scale = F.embedding(scales.int(), _E8M0_LUT.to(packed.device))  # [rows, Kp/32, 1]
    else:
        scale = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    if global_scale is not None:
        scale = scale * global_scale.float().reshape(-1, 1, 1)
    values.mul_(scale)
    return values.view(rows, -1).to(dtype)


def fp4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    scale_kind: ScaleKind,
    input_size: int,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """``x [T, K] @ W^T (+ bias)`` with ``W`` dequantized ``tile_rows`` output rows at a time.

    Args:
        x: activations; the dequantized tile is cast to ``x.dtype``.
        packed: ``[N, Kp/2]`` uint8.
        scales: ``[N, Kp/GROUP]`` uint8 (E8M0) or float8_e4m3fn / uint8 (E4M3) bytes.
        scale_kind: ``"e8m0"`` (MXFP4) or ``"e4m3"`` (NVFP4).
        input_size: K (the padding ``Kp - K`` is dropped).
        global_scale: float32 ``[N]`` per-row global multiplier (NVFP4) or None.
        bias: ``[N]`` or None.
        tile_rows: rows per tile; default keeps a tile near 1M elements.

    Returns:
        ``[T, N]`` in ``x.dtype``.
    """
    n = packed.shape[0]
    if tile_rows is None:
        tile_rows = max(1, _TILE_ELEMENTS // max(1, packed.shape[1] * 2))
    if tile_rows >= n:
        w = dequantize_fp4_rows(packed, scales, scale_kind, global_scale, x.dtype)
        return F.linear(x, w[:, :input_size], bias)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, tile_rows):
        stop = min(n, start + tile_rows)
        g = None if global_scale is None else global_scale[start:stop]
        w = dequantize_fp4_rows(packed[start:stop], scales[start:stop], scale_kind, g, x.dtype)
        b = None if bias is None else bias[start:stop]
        out[..., start:stop] = F.linear(x, w[:, :input_size], b)
    return out


if HAS_TRITON:

    @triton.jit
    def _fp4_gemm_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, bias_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ym, stride_yn,
        stride_ys, K_PER_SPLIT,
        GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    ):
        """``y[m, n] = Σ_k x[m, k] · e2m1(w[n, k]) · scale[n, k // GROUP] (· g[n]) + bias[n]``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        k_first = pid_k * K_PER_SPLIT
        offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k0 in range(0, (K_PER_SPLIT + BLOCK_SIZE_K - 1) // BLOCK_SIZE_K):
            offs_k = k_first + k0 * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wk_mask = n_ok[:, None] & k_ok[None, :]
            byte = tl.load(w_ptr + offs_n[:, None] * stride_wn + (offs_k[None, :] // 2) * stride_wk,
                           mask=wk_mask, other=0).to(tl.int32)
            code = (byte >> ((offs_k[None, :] % 2) * 4)) & 0xF
            exp = (code >> 1) & 3
            man = (code & 1).to(tl.float32)
            mag = tl.where(exp == 0, 0.5 * man,
                           tl.exp2((exp - 1).to(tl.float32)) * (1.0 + 0.5 * man))
            val = tl.where((code >> 3) == 1, -mag, mag)
            s_ptrs = s_ptr + offs_n[:, None] * stride_sn + (offs_k[None, :] // GROUP) * stride_sk
            sb = tl.load(s_ptrs, mask=wk_mask, other=0).to(tl.int32)
            if SCALE_E8M0:
                scale = tl.exp2((sb - 127).to(tl.float32))
            else:
                se = (sb >> 3) & 15
                sm = (sb & 7).to(tl.float32)
                scale = tl.where(se == 0, sm * 0.001953125,  # 2^-9 per mantissa step
                                 tl.exp2((se - 7).to(tl.float32)) * (1.0 + sm * 0.125))
            w = (val * scale).to(x.dtype)  # [BLOCK_N, BLOCK_K]
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if HAS_GLOBAL:
            g = tl.load(g_ptr + offs_n, mask=n_ok, other=0.0)
            acc = acc * g[None, :]
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym
        tl.store(y_ptrs + offs_n[None, :] * stride_yn,
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch_config(m: int, n: int, k: int) -> dict[str, Any]:
    default = dict(DEFAULT_CONFIG)
    if m > 16:
        default["BLOCK_SIZE_M"] = 64
    try:
        from inference_engine.kernel_tuning import tuning_config
    except ImportError:  # pragma: no cover - older core without the tuning helper
        return default
    bucket = 1 << max(0, (max(m, 1) - 1).bit_length())  # tables hold M buckets, not every M
    return tuning_config("fp4_gemm", {"M": bucket, "N": n, "K": k}, default)


def fp4_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    scale_kind: ScaleKind,
    input_size: int,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Same contract as :func:`fp4_linear_reference`, in one Triton launch (any M).

    Raises:
        RuntimeError: when Triton is not installed.
    """
    if not HAS_TRITON:
        raise RuntimeError("fp4_linear_triton needs triton "
                           "(pip install inference-engine-quant[triton])")
    group = _group_of(scale_kind)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = packed.shape[0]
    if k != input_size:
        raise ValueError(f"activations have {k} columns, the layer expects {input_size}")
    scales_u8 = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    cfg = {"SPLIT_K": 0, **(config or _launch_config(m, n, k))}
    block_k = cfg["BLOCK_SIZE_K"]
    split = int(cfg["SPLIT_K"])
    if split <= 0:
        split = auto_split_k(m, n, k, cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], block_k)
    per_split = (k + split - 1) // split
    k_per_split = (per_split + block_k - 1) // block_k * block_k
    split = (k + k_per_split - 1) // k_per_split
    # Split-K (small M): float32 partials per split, summed here in a fixed order.
    y = (torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1
         else torch.empty(split, m, n, dtype=torch.float32, device=x.device))
    grid = (triton.cdiv(m, cfg["BLOCK_SIZE_M"]), triton.cdiv(n, cfg["BLOCK_SIZE_N"]), split)
    g = global_scale.float().contiguous() if global_scale is not None else y
    b = bias if bias is not None else y
    _fp4_gemm_kernel[grid](
        x2, packed, scales_u8, g, b, y, m, n, k,
        x2.stride(0), x2.stride(1), packed.stride(0), packed.stride(1),
        scales_u8.stride(0), scales_u8.stride(1), y.stride(-2), y.stride(-1),
        y.stride(0) if split > 1 else 0, k_per_split,
        GROUP=group, SCALE_E8M0=scale_kind == "e8m0", HAS_GLOBAL=global_scale is not None,
        HAS_BIAS=bias is not None and split == 1, IEEE=x.dtype == torch.float32,
        BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"],
        BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1:
        y = y.sum(dim=0)
        if bias is not None:
            y += bias.float()
        y = y.to(x.dtype)
    return y.reshape(*lead, n)
