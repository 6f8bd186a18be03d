"""Fused MoE on GPUs: a Triton grouped GEMM over tokens sorted by expert.

The (token, slot) assignments are sorted by expert and padded so that every
``BLOCK_SIZE_M`` rows belong to one expert (:func:`align_block_size`); each
program multiplies one such block by a ``BLOCK_SIZE_N`` slice of its expert's
weight. Experts without tokens get no block. Two launches make one MoE
layer: ``x @ gate_up[e]^T`` (rows read from the token), the activation,
then ``act @ down[e]^T`` scaled by the routing weight, summed per token.

Launch parameters come from the ``ie_kernel_tuning_config`` hook (op
``"fused_moe"``, shape keys ``M N K E topk``) through
``inference_engine.kernel_tuning.tuning_config``, so a platform plugin can
ship tuned tables. Checked against the plain reference under
``TRITON_INTERPRET=1`` in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from inference_engine.kernel_tuning import tuning_config
from inference_engine.layers.moe.activation import SILU, ExpertActivation, expert_activation
from inference_engine.layers.moe.dispatch import align_block_size

__all__ = ["GroupedGemm", "default_config", "fused_moe_triton", "grouped_moe", "launch_config",
           "moe_block_rows", "moe_store_block"]


@triton.jit
def moe_block_rows(sorted_ids_ptr, block_expert_ptr, num_padded_ptr, N, num_valid, max_padded,
                   BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                   GROUP_SIZE_M: tl.constexpr):
    """This program's block of expert-sorted rows and slice of output columns:
    ``(rows, row_ok, expert, offs_n, n_ok)``. Shared by every grouped MoE GEMM kernel."""
    pid = tl.program_id(0)
    # Plain integer ceil-divisions (tl.cdiv is a jit function the interpreter cannot call
    # when triton was imported before TRITON_INTERPRET was set).
    num_pid_m = (max_padded + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M
    num_pid_n = (N + BLOCK_SIZE_N - 1) // BLOCK_SIZE_N
    # Grouped ordering: GROUP_SIZE_M row blocks share each weight slice while it is in cache.
    group = GROUP_SIZE_M * num_pid_n
    first_m = (pid // group) * GROUP_SIZE_M
    group_m = min(num_pid_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + ((pid % group) % group_m)
    pid_n = (pid % group) // group_m
    # The grid covers the static bound on padded rows. Blocks past the rows in use read no
    # activations and store nothing; they still read expert 0's weights (one expert, so mostly
    # from L2). NOTE: a mask, not an early return: the interpreter (TRITON_INTERPRET=1) of some
    # Triton versions cannot branch on a loaded value.
    num_padded = tl.load(num_padded_ptr)
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    # All true or all false: num_padded is a whole number of blocks.
    row_ok = (rows < num_valid) & (offs_m < num_padded)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_ok = offs_n < N
    return rows, row_ok, expert, offs_n, n_ok


@triton.jit
def moe_store_block(acc, c_ptr, bias_ptr, weight_ptr, rows, row_ok, expert, offs_n, n_ok,
                    stride_cm, stride_cn, stride_bias_e, HAS_BIAS: tl.constexpr,
                    MUL_WEIGHT: tl.constexpr):
    """``c[rows, offs_n] = (acc + bias[expert]) * w[rows]`` for the rows in use."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_ok, other=0.0)
        acc += bias[None, :].to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * w[:, None].to(tl.float32)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
    num_padded_ptr, N, K, num_valid, max_padded,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias_e,
    ROWS_PER_A: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
):
    """``c[r] = (a[r // ROWS_PER_A] @ b[expert(r)]^T + bias) * w[r]`` for sorted rows ``r``."""
    rows, row_ok, expert, offs_n, n_ok = moe_block_rows(
        sorted_ids_ptr, block_expert_ptr, num_padded_ptr, N, num_valid, max_padded,
        BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (rows[:, None] // ROWS_PER_A) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (b_ptr + expert * stride_be + offs_k[:, None] * stride_bk
              + offs_n[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kb in range(0, (K + BLOCK_SIZE_K - 1) // BLOCK_SIZE_K):
        k_left = K - kb * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    moe_store_block(acc, c_ptr, bias_ptr, weight_ptr, rows, row_ok, expert, offs_n, n_ok,
                    stride_cm, stride_cn, stride_bias_e, HAS_BIAS, MUL_WEIGHT)


def default_config(shape: dict[str, int]) -> dict[str, Any]:
    """Launch parameters when no plugin or platform answers: small blocks for decode sizes."""
    if shape["M"] * shape["topk"] <= shape["E"] * 4:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 2}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8,
            "num_warps": 4, "num_stages": 2}


def launch_config(shape: dict[str, int]) -> dict[str, Any]:
    """The tuning hook's answer for this shape (cached by the helper), else the default."""
    return tuning_config("fused_moe", shape, default_config(shape))


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
                  weights: torch.Tensor | None, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, num_padded: torch.Tensor, rows_per_a: int,
                  config: dict[str, Any]) -> None:
    """One grouped GEMM; the grid is sized by ``sorted_ids``' static length, ``num_padded``
    (a device tensor) says how many rows are in use."""
    n, k = b.shape[1], b.shape[2]
    max_padded = sorted_ids.shape[0]
    bm, bn = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"]
    grid = (triton.cdiv(max_padded, bm) * triton.cdiv(n, bn),)
    dummy = c  # unused pointer arguments when a feature is off
    _grouped_gemm_kernel[grid](
        a, b, c, bias if bias is not None else dummy, weights if weights is not None else dummy,
        sorted_ids, block_expert, num_padded, n, k, c.shape[0], max_padded,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), bias.stride(0) if bias is not None else 0,
        ROWS_PER_A=rows_per_a, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn,
        BLOCK_SIZE_K=config["BLOCK_SIZE_K"], GROUP_SIZE_M=config["GROUP_SIZE_M"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


# One grouped GEMM launch of a two-GEMM MoE layer: (which, a, c, routing weights or None,
# sorted_ids, block_expert, num_padded, rows_per_a, config); ``which`` is "gate_up" or "down".
GroupedGemm = Callable[[str, torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor,
                        torch.Tensor, torch.Tensor, int, dict[str, Any]], None]


def grouped_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                up_rows: int, out_dim: int, activation: ExpertActivation, gemm: GroupedGemm,
                config_up: dict[str, Any], config_down: dict[str, Any]) -> torch.Tensor:
    """A layer's two grouped-GEMM launches around the activation, for any weight format.

    Assignments are sorted by expert and block-aligned on the device; the first launch reads
    each row's token (``rows_per_a = k``), the second multiplies by the routing weight, and
    the ``k`` outputs of a token are summed. ``gemm`` launches one GEMM over the weights it
    holds (dense here, quantized in the quant plugin).
    """
    t, k = ids.shape
    sorted_ids, block_expert, num_padded = align_block_size(ids, num_experts,
                                                            config_up["BLOCK_SIZE_M"])
    h = torch.empty(t * k, up_rows, dtype=x.dtype, device=x.device)
    gemm("gate_up", x, h, None, sorted_ids, block_expert, num_padded, k, config_up)
    act = expert_activation(h, activation)
    y = torch.empty(t * k, out_dim, dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    if config_down["BLOCK_SIZE_M"] != config_up["BLOCK_SIZE_M"]:
        sorted_ids, block_expert, num_padded = align_block_size(ids, num_experts,
                                                                config_down["BLOCK_SIZE_M"])
    gemm("down", act, y, flat_weights, sorted_ids, block_expert, num_padded, 1, config_down)
    return y.view(t, k, -1).sum(dim=1)


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: ExpertActivation = SILU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`~inference_engine.layers.moe.reference.fused_moe_reference`."""
    t, k = ids.shape
    num_experts, up_rows, hidden = gate_up.shape
    shape = {"M": t, "N": up_rows, "K": hidden, "E": num_experts, "topk": k}
    operands = {"gate_up": (gate_up, gate_up_bias), "down": (down, down_bias)}

    def gemm(which: str, a: torch.Tensor, c: torch.Tensor, routing: torch.Tensor | None,
             sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor,
             rows_per_a: int, config: dict[str, Any]) -> None:
        b, bias = operands[which]
        _grouped_gemm(a, b, c, bias, routing, sorted_ids, block_expert, num_padded,
                      rows_per_a, config)

    return grouped_moe(x, ids, weights, num_experts, up_rows, down.shape[1], activation, gemm,
                       launch_config(shape),
                       launch_config({**shape, "N": down.shape[1], "K": down.shape[2]}))
