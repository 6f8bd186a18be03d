"""Triton FP8 block-scaled GEMM over the engine's (K, N) weight layout.

One kernel covers every FP8 scheme the engine runs: the weight ``b [K, N]``
has a scale per ``(GROUP_K x GROUP_N)`` block (``GROUP_N = 1``: per output
channel; ``GROUP_K = K``: one block along K), the activation ``a [M, K]`` a
scale per row and ``GROUP_K`` columns (or none: weight-only, the SM75-86
fallback, where the weight tile is converted to the activation dtype inside
the kernel). For each K step the partial product of the raw FP8 (or upcast)
tiles is multiplied by ``s_a[m, g] * s_b[g, n // GROUP_N]`` and accumulated in
float32, as in vLLM's ``w8a8_block_fp8_matmul``.

Any M works (the odd-M tail and M = 1 decode are masked). Two launch shapes,
both the same kernel: large M tiles the output (grouped ordering so row
blocks share a weight slice in L2); small M (decode) has too few output tiles
to keep every SM streaming weights, so K is split over ``SPLIT_K`` programs per
tile (split-K), each writing a float32 partial sum that the wrapper adds up in
a fixed order (deterministic, unlike atomics). ``SPLIT_K`` comes from the
tuning table, or from :func:`auto_split_k` (enough programs to cover the GPU). The plain-PyTorch
ground truth is :func:`inference_engine_quant.fp8_math.reference_fp8_linear`;
tests run this kernel under ``TRITON_INTERPRET=1`` on float32-upcast inputs
(the interpreter has no FP8), on a GPU it gets FP8 tensors directly.
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

__all__ = ["DEFAULT_CONFIG", "HAS_TRITON", "auto_split_k", "fp8_block_gemm"]

HAS_TRITON = triton is not None

# Programs a launch should have at least to keep a GPU's SMs busy (132 on H100/H200;
# a few per SM hide latency); only used when the config leaves SPLIT_K to the heuristic.
TARGET_PROGRAMS = 264

DEFAULT_CONFIG: dict[str, Any] = {
    "SPLIT_K": 0,  # 0: choose by auto_split_k
    "BLOCK_SIZE_M": 64,
    "BLOCK_SIZE_N": 128,
    "BLOCK_SIZE_K": 128,
    "GROUP_SIZE_M": 8,
    "num_warps": 4,
    "num_stages": 3,
}


if HAS_TRITON:

    @triton.jit
    def _fp8_block_gemm_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr,
        M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        stride_as_m, stride_as_g, stride_bs_g, stride_bs_n, stride_cs, K_PER_SPLIT,
        SPLIT_K: tl.constexpr, GROUP_K: tl.constexpr, GROUP_N: tl.constexpr,
        HAS_A_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr,
    ):
        pid = tl.program_id(axis=0)
        pid_k = tl.program_id(axis=1)
        num_pid_m = (M + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M
        num_pid_n = (N + BLOCK_SIZE_N - 1) // BLOCK_SIZE_N
        num_pid_in_group = GROUP_SIZE_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_SIZE_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        k_first = pid_k * K_PER_SPLIT
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k_first + offs_k[None, :]) * stride_ak
        b_ptrs = b_ptr + (k_first + offs_k[:, None]) * stride_bk + offs_n[None, :] * stride_bn
        bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bs_n
        as_ptrs = as_ptr + offs_m * stride_as_m

        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k0 in range(0, (K_PER_SPLIT + BLOCK_SIZE_K - 1) // BLOCK_SIZE_K):
            k_start = k_first + k0 * BLOCK_SIZE_K
            k_mask = offs_k < K - k_start
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & mask_n[None, :], other=0.0)
            g = k_start // GROUP_K
            b_s = tl.load(bs_ptrs + g * stride_bs_g, mask=mask_n, other=0.0)
            if HAS_A_SCALE:
                a_s = tl.load(as_ptrs + g * stride_as_g, mask=mask_m, other=0.0)
                part = tl.dot(a, b)
                acc += part * a_s[:, None] * b_s[None, :]
            else:
                part = tl.dot(a, b.to(a.dtype))
                acc += part * b_s[None, :]
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk

        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        # Split-K: each split stores its float32 partial in its own slice of c (the wrapper
        # sums them and adds the bias; HAS_BIAS is off then).
        c_ptrs = (c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm
                  + offs_n[None, :] * stride_cn)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])



def auto_split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
                 target_programs: int = TARGET_PROGRAMS) -> int:
    """Splits of K (a power of two) that bring the launch to ``target_programs``, each split
    keeping at least two K blocks; 1 when the output tiles alone are enough (large M)."""
    tiles = -(-m // block_m) * -(-n // block_n)
    k_blocks = -(-k // block_k)
    split = 1
    while tiles * split * 2 <= target_programs and k_blocks >= split * 4:
        split *= 2
    return split


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_k: int,
    group_n: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``c [M, N] = sum_g (a_g @ b_g) * a_scale[:, g] * b_scale[g, n // group_n] (+ bias)``.

    Args:
        a: ``[M, K]`` FP8 (or its float32 upcast), or 16-bit for weight-only.
        a_scale: ``[M, ceil(K / group_k)]`` float32, or None (weight-only).
        b: ``[K, N]`` FP8 weight (any strides).
        b_scale: ``[ceil(K / group_k), ceil(N / group_n)]`` float32.
        group_k: K extent of one scale block; ``>= K`` for a single block.
        group_n: N extent of one weight-scale block (1: per channel).
        out_dtype: dtype of ``c``.
        bias: optional ``[N]``.
        config: launch parameters (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps,
            num_stages, SPLIT_K: 0 or absent chooses by :func:`auto_split_k`);
            default :data:`DEFAULT_CONFIG`. ``BLOCK_SIZE_K`` is
            lowered to divide ``group_k`` when needed.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: for shapes that do not agree, naming them.
    """
    if not HAS_TRITON:
        raise RuntimeError("the triton FP8 GEMM needs triton: "
                           "pip install 'inference-engine-quant[triton]'")
    m, k = a.shape
    kb, n = b.shape
    if kb != k:
        raise ValueError(f"fp8_block_gemm: a is {tuple(a.shape)} but b is {tuple(b.shape)} "
                         f"(K differs)")
    groups = -(-k // group_k)
    if tuple(b_scale.shape) != (groups, -(-n // group_n)):
        raise ValueError(f"fp8_block_gemm: b_scale is {tuple(b_scale.shape)}, expected "
                         f"{(groups, -(-n // group_n))} for K={k}, N={n}, "
                         f"blocks {group_k}x{group_n}")
    if a_scale is not None and tuple(a_scale.shape) != (m, groups):
        raise ValueError(f"fp8_block_gemm: a_scale is {tuple(a_scale.shape)}, "
                         f"expected {(m, groups)}")
    cfg = dict(DEFAULT_CONFIG if config is None else config)
    block_k = int(cfg["BLOCK_SIZE_K"])
    if group_k < k:
        # Each K step must stay inside one scale group.
        while group_k % block_k:
            block_k //= 2
    block_k = max(block_k, 16)
    if m == 0:
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    split = int(cfg.get("SPLIT_K", 0))
    if split <= 0:
        split = auto_split_k(m, n, k, cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], block_k)
    # Each split covers whole K blocks (so a K step never straddles two splits).
    per_split = (k + split - 1) // split
    k_per_split = (per_split + block_k - 1) // block_k * block_k
    split = (k + k_per_split - 1) // k_per_split
    if split == 1:
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        stride_cs = 0
    else:
        c = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        stride_cs = c.stride(0)
    a_s = a_scale if a_scale is not None else b_scale  # dummy pointer when unused
    grid = (triton.cdiv(m, cfg["BLOCK_SIZE_M"]) * triton.cdiv(n, cfg["BLOCK_SIZE_N"]), split)
    _fp8_block_gemm_kernel[grid](
        a, b, c, a_s, b_scale, bias if bias is not None else b_scale,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(-2), c.stride(-1),
        a_s.stride(0), a_s.stride(1), b_scale.stride(0), b_scale.stride(1),
        stride_cs, k_per_split, SPLIT_K=split,
        GROUP_K=min(group_k, max(k, 1)) if group_k >= k else group_k,
        GROUP_N=group_n,
        HAS_A_SCALE=a_scale is not None, HAS_BIAS=bias is not None and split == 1,
        BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"],
        BLOCK_SIZE_K=block_k, GROUP_SIZE_M=cfg["GROUP_SIZE_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split == 1:
        return c
    out = c.sum(dim=0)
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)
