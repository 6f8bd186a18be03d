"""Triton kernels for the small per-token ops of a decoder layer, one launch each.

On a GPU each of these is otherwise several torch launches per layer (square,
mean, rsqrt, multiply and the residual add of an RMSNorm; the SiLU and the
product; a multiply and two multiply-adds per rotary). Each kernel here
reproduces the rounding of the torch path it replaces, step by step, in the
tensor's dtype, so bf16 outputs agree with the torch reference (and with
transformers) to the last bit but for rare one-ulp differences where a float32
intermediate lands by a rounding boundary (the order of a row's float32 sum, the
hardware's approximate ``exp``, fused multiply-adds):

- :func:`rms_norm`: :class:`~inference_engine.layers.norm.RMSNorm` (reference
  :func:`~inference_engine.layers.norm.rms_norm_torch`);
- :func:`silu_and_mul`: :class:`~inference_engine.layers.mlp.GatedMLP`'s activation
  (reference :func:`~inference_engine.layers.mlp.silu_and_mul_torch`);
- :func:`rotary` / :func:`rotary_qk`: :meth:`RotaryTable.rotate` (neox halves, partial
  rotary; reference :func:`~inference_engine.layers.rotary.rotate_torch`);
- :func:`qk_norm_rotary`: Qwen3's per-head q/k RMSNorm followed by rotary, in one pass
  (reference: the norm layer's then the rotary table's torch functions).

Nothing here reads a device value on the host (no ``.item()``), so all of it can
be captured in a CUDA graph. Rows of any width are padded to a power of two
and masked.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

__all__ = ["RotaryRows", "qk_norm_rotary", "rms_norm", "rotary", "rotary_qk",
           "silu_and_mul"]


class RotaryRows(Protocol):
    """What the rotary kernels read of a step's ``layers.rotary.RotaryTable`` (named
    structurally, so the kernels do not import the layer that calls them)."""

    # [T, 2 * rot_dim]: cos (repeated for both halves), -sin and sin per position.
    rows: torch.Tensor
    rot_dim: int


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


# ---- RMSNorm -------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, sum_ptr, B, x_sa, x_sb, r_sa, r_sb,
                     P, D, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row r = a * B + b of x [A, B, D]; the weight row is r % P.
    row = tl.program_id(0).to(tl.int64)
    a = row // B
    b = row % B
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + a * x_sa + b * x_sb + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a * r_sa + b * r_sb + offs, mask=mask, other=0.0)
        # Rounded to the dtype first, exactly as torch's ``x + residual``.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + offs, x, mask=mask)
    xf = x.to(tl.float32)
    # rsqrt, as torch's rms_norm and the float32 path compute it.
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    # LlamaRMSNorm's order: the normalised value in x's dtype, then the weight.
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + (row % P) * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[A, B, D]`` with a unit last stride (a view where possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, 1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x [..., D]`` (or of ``x + residual``), in one launch.

    Args:
        x: ``[T, D]`` or ``[T, H, D]`` (any strides but the last; column slices of a
            fused projection need no copy).
        weight: ``[D]``, or ``[P, D]`` where flattened row ``r`` uses ``weight[r % P]``
            (``[heads, head_dim]`` for per-head q/k norm of ``x [T, heads, head_dim]``).
        eps: added to the mean square.
        residual: same shape as ``x``; then ``x + residual`` (rounded to ``x.dtype``) is
            normalised.

    Returns:
        The normalised ``[..., D]`` in ``x.dtype`` (contiguous); with ``residual``,
        ``(normed, x + residual)``.
    """
    d = x.shape[-1]
    rows = _as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    res = _as_rows(residual) if residual is not None else rows
    num_rows = rows.shape[0] * rows.shape[1]
    if num_rows:
        w = weight.contiguous()
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(num_rows,)](
            rows, w, res, out, total, rows.shape[1], rows.stride(0), rows.stride(1),
            res.stride(0), res.stride(1), w.numel() // d, d, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block))
    return (out, total) if residual is not None else out


# ---- SiLU and multiply ------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, N, gu_stride, BLOCK: tl.constexpr):
    # Program (t, j): columns [j * BLOCK, (j + 1) * BLOCK) of row t.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(gu_ptr + t * gu_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * gu_stride + N + offs, mask=mask, other=0.0).to(tl.float32)
    # torch's rounding: silu in the dtype, then the product in the dtype. NOTE: tl.exp may
    # be the fast approximate exponential, a few float32 ulps from torch's; a bf16 result
    # then differs from torch's by one ulp in rare elements.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * N + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2N]`` (gate first; rows may be strided).

    Returns:
        ``[T, N]`` in ``gate_up.dtype``.
    """
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    t, n = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), BLOCK=block, num_warps=_num_warps(block))
    return out


# ---- rotary (and per-head q/k norm before it) -------------------------------------


@triton.jit
def _rotary_kernel(x_ptr, y_ptr, out_x_ptr, out_y_ptr, tab_ptr, wx_ptr, wy_ptr,
                   HX, HY, x_st, x_sh, y_st, y_sh, tab_st, D, R, eps,
                   NORM: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                   HAS_TAIL: tl.constexpr):
    # Program (t, hd): head hd of token t, a head of x for hd < HX, else head hd - HX of y.
    # The table row t is [cos (R: both halves) | -sin (R / 2) | sin (R / 2)].
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)
    if hd < HX:
        src = x_ptr + t * x_st + hd * x_sh
        dst = out_x_ptr + (t * HX + hd) * D
        w_row = wx_ptr
    else:
        src = y_ptr + t * y_st + (hd - HX) * y_sh
        dst = out_y_ptr + (t * HY + (hd - HX)) * D
        w_row = wy_ptr
    dtype = out_x_ptr.dtype.element_ty
    h = R // 2
    offs = tl.arange(0, HALF_BLOCK)
    m = offs < h
    x1 = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + h + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_TAIL:
        tail_offs = R + tl.arange(0, TAIL_BLOCK)
        tail_m = tail_offs < D
        tail = tl.load(src + tail_offs, mask=tail_m, other=0.0).to(tl.float32)
    if NORM:
        ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
        if HAS_TAIL:
            ss += tl.sum(tail * tail, axis=0)
        inv = tl.math.rsqrt(ss / D + eps)
        w1 = tl.load(w_row + offs, mask=m, other=0.0).to(tl.float32)
        w2 = tl.load(w_row + h + offs, mask=m, other=0.0).to(tl.float32)
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        if HAS_TAIL:
            wt = tl.load(w_row + tail_offs, mask=tail_m, other=0.0).to(tl.float32)
            tail = ((tail * inv).to(dtype).to(tl.float32) * wt).to(dtype).to(tl.float32)
    tab = tab_ptr + t * tab_st
    cos1 = tl.load(tab + offs, mask=m, other=0.0).to(tl.float32)
    cos2 = tl.load(tab + h + offs, mask=m, other=0.0).to(tl.float32)
    neg_sin = tl.load(tab + R + offs, mask=m, other=0.0).to(tl.float32)
    sin = tl.load(tab + R + h + offs, mask=m, other=0.0).to(tl.float32)
    # RotaryTable.rotate's rounding: x * cos in the dtype, then one multiply-add.
    o1 = (x1 * cos1).to(dtype).to(tl.float32) + x2 * neg_sin
    o2 = (x2 * cos2).to(dtype).to(tl.float32) + x1 * sin
    tl.store(dst + offs, o1.to(dtype), mask=m)
    tl.store(dst + h + offs, o2.to(dtype), mask=m)
    if HAS_TAIL:
        tl.store(dst + tail_offs, tail.to(dtype), mask=tail_m)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x [T, H*D]`` or ``[T, H, D]`` as ``[T, H, D]`` with a unit last stride."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.view(x.shape[0], -1, head_dim) if x.dim() == 2 else x


def _launch_rotary(x: torch.Tensor, y: torch.Tensor | None, rows: torch.Tensor, rot_dim: int,
                   weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                   eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, hx, d = x.shape
    hy = y.shape[1] if y is not None else 0
    out_x = torch.empty((t, hx, d), dtype=x.dtype, device=x.device)
    out_y = torch.empty((t, hy, d), dtype=x.dtype, device=x.device) if y is not None else None
    yy = y if y is not None else x
    wx, wy = weights if weights is not None else (rows, rows)  # unread without NORM
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if t and hx + hy:
        half = rot_dim // 2
        tail = d - rot_dim
        _rotary_kernel[(t, hx + hy)](
            x, yy, out_x, out_y if out_y is not None else out_x, rows, wx, wy, hx, hy,
            x.stride(0), x.stride(1), yy.stride(0), yy.stride(1), rows.stride(0), d, rot_dim,
            float(eps), NORM=weights is not None,
            HALF_BLOCK=triton.next_power_of_2(max(half, 1)),
            TAIL_BLOCK=triton.next_power_of_2(max(tail, 1)), HAS_TAIL=tail > 0,
            num_warps=_num_warps(triton.next_power_of_2(d)))
    return out_x, out_y


def rotary(table: RotaryRows, x: torch.Tensor) -> torch.Tensor:
    """A rotated copy of ``x [T, H, D]`` (any strides but the last), as ``table.rotate``.

    Same signature as :func:`~inference_engine.layers.rotary.rotate_torch`.
    """
    out, _ = _launch_rotary(_heads(x, x.shape[-1]), None, table.rows, table.rot_dim)
    return out.view(x.shape)


def rotary_qk(table: RotaryRows, q: torch.Tensor,
              k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q`` and ``k`` (``[T, heads * D]`` or ``[T, heads, D]``) in one launch.

    Returns:
        ``(q_rot, k_rot)`` with the shapes of ``q`` and ``k``, contiguous.
    """
    d = table.head_dim
    out_q, out_k = _launch_rotary(_heads(q, d), _heads(k, d), table.rows, table.rot_dim)
    return out_q.view(q.shape), out_k.view(k.shape)


def qk_norm_rotary(table: RotaryRows, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of ``q [T, H, D]`` and ``k [T, KV, D]`` (weights ``[D]`` each), then
    rotary, in one launch (Qwen3's attention input).

    Rounds as the norm then the rotation in torch: normalised value, weighted value, ``x * cos``
    and the rotated value each in the dtype.

    Returns:
        ``(q_out [T, H, D], k_out [T, KV, D])``, contiguous.
    """
    d = q.shape[-1]
    out_q, out_k = _launch_rotary(_heads(q, d), _heads(k, d), table.rows, table.rot_dim,
                                  (q_weight.contiguous(), k_weight.contiguous()), eps)
    return out_q, out_k

