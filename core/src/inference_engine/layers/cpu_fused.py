"""Fused float32 CPU kernels for the small per-token ops of a decoder layer (and the pick).

A batch-1 decode step spends as long dispatching the ~25 RMSNorms (each a
handful of torch ops: square, mean, rsqrt, multiply, residual add) and the
SiLU-and-multiply as it does computing them. These C++ loops do each in one
call: RMSNorm with an optional residual add and an optional per-row-period
weight (so the q and k heads of a layer are normalised with their own weights
in one pass), ``silu(gate) * up`` on a fused gate/up output, and the greedy
pick (``argmax`` of each row of logits). Built with
``-ffast-math`` (vectorised ``exp``; results within a few float32 ulps).

Float32 CPU tensors only; everything else, or a machine where the build fails
(or ``INFERENCE_ENGINE_CPU_KERNELS=0``), uses the torch ops, which are the
reference these are tested against.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_engine.cpu_thread_pool import load_pooled_extension

__all__ = ["fused_argmax", "fused_kernels", "fused_rms_norm", "fused_rope",
           "fused_silu_and_mul"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

PARALLEL_TASKS

namespace {
// Rows per task: at least ~32K elements, so decode-sized inputs run on the calling thread.
int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
}

// body(begin, end) over [0, rows) in tasks of `grain` rows, on the spinning pool where
// it is on (under OMP_WAIT_POLICY=PASSIVE waking OpenMP's threads per call cost more).
template <class F>
void for_rows(int64_t rows, int64_t grain, const F& body) {
  if (rows <= grain) {
    body(0, rows);
    return;
  }
  parallel_tasks((rows + grain - 1) / grain, [&](int64_t task) {
    body(task * grain, std::min(rows, (task + 1) * grain));
  });
}
}

// x [A, B, D] (any strides for A and B, elements contiguous), rows r = a * B + b;
// weight [P, D] float32 or empty (row r uses weight row r % P); residual [A, B, D] or
// empty: then x + residual is what is normalised, and returned too.
// Returns {normalised rows [A, B, D], sum [A, B, D] (or an empty tensor)}.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor residual,
                                    double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1);
  const int64_t B = x.size(1), R = x.size(0) * B, D = x.size(2);
  const int64_t xa = x.stride(0), xb = x.stride(1);
  const bool has_w = weight.numel() > 0, has_r = residual.numel() > 0;
  if (has_w) TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                         weight.size(-1) == D && weight.numel() % D == 0);
  if (has_r) TORCH_CHECK(residual.scalar_type() == torch::kFloat32 && residual.dim() == 3 &&
                         residual.stride(2) == 1 && residual.sizes() == x.sizes());
  const int64_t P = has_w ? weight.numel() / D : 1;
  const int64_t ra = has_r ? residual.stride(0) : 0, rb = has_r ? residual.stride(1) : 0;
  auto out = torch::empty(x.sizes(), x.options());
  auto sum = has_r ? torch::empty(x.sizes(), x.options()) : torch::empty({0}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = has_w ? weight.data_ptr<float>() : nullptr;
  const float* rp = has_r ? residual.data_ptr<float>() : nullptr;
  float* sp = has_r ? sum.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(R, grain_rows(D), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const float* src = xp + (r / B) * xa + (r % B) * xb;
      if (has_r) {
        const float* rr = rp + (r / B) * ra + (r % B) * rb;
        float* sr = sp + r * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) sr[i] = src[i] + rr[i];
        src = sr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + e);
      float* orow = op + r * D;
      if (has_w) {
        const float* wr = wp + (r % P) * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) orow[i] = (src[i] * inv) * wr[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) orow[i] = src[i] * inv;
      }
    }
  });
  return {out, sum};
}

// gate_up [T, 2I] (rows may be strided) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 &&
              gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0);
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(T, grain_rows(I), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* g = gp + t * gs;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      // exp's argument is capped so that -ffast-math never meets an infinity
      // (silu(g) for g < -80 is below 1e-33 either way).
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];
    }
  });
  return out;
}

// x [T, H, D] (any strides for T and H, elements contiguous); table [T, 2R] float32 rows
// [cos (R, both halves) | -sin (R/2) | sin (R/2)]. Returns x with its first R dims of
// every head rotated as neox halves, contiguous [T, H, D].
torch::Tensor rope_neox(torch::Tensor x, torch::Tensor table) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kFloat32 && table.stride(1) == 1);
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = table.size(1) / 2, h = R / 2;
  TORCH_CHECK(table.size(0) == T && R % 2 == 0 && R <= D, "table does not fit x");
  auto out = torch::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xt = x.stride(0), xh = x.stride(1), ts = table.stride(0);
  for_rows(T * H, grain_rows(D), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const int64_t t = r / H;
      const float* src = xp + t * xt + (r % H) * xh;
      const float* cs = tp + t * ts;
      const float* ns = cs + R;
      const float* sn = ns + h;
      float* dst = op + r * D;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) dst[i] = src[i] * cs[i] + src[i + h] * ns[i];
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) dst[i + h] = src[i + h] * cs[i + h] + src[i] * sn[i];
      for (int64_t i = R; i < D; ++i) dst[i] = src[i];
    }
  });
  return out;
}

// x [T, V] float32 (rows may be strided) -> int64 [T]: torch.argmax(x, -1), the first
// maximum of each row, or its first NaN (torch ranks NaN above everything). Compared as
// order-preserving integer keys of the float bits (-0 taken as +0), so -ffast-math's
// assumptions (no NaN, no infinity) cannot touch it.
inline int32_t order_key(uint32_t bits) {
  if (bits == 0x80000000u) bits = 0;
  const int32_t i = static_cast<int32_t>(bits);
  return i ^ ((i >> 31) & 0x7fffffff);
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1 &&
              x.size(1) > 0);
  const int64_t T = x.size(0), V = x.size(1), xs = x.stride(0);
  auto out = torch::empty({T}, torch::dtype(torch::kInt64));
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  int64_t* op = out.data_ptr<int64_t>();
  constexpr int64_t kChunk = 64;
  for_rows(T, grain_rows(V), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const uint32_t* bits = xp + t * xs;
      int32_t best = INT32_MIN;
      int nan = 0;
#pragma omp simd reduction(max:best) reduction(|:nan)
      for (int64_t i = 0; i < V; ++i) {
        best = std::max(best, order_key(bits[i]));
        nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
      }
      // The first index that matches, a chunk at a time.
      int64_t pick = 0;
      for (int64_t c = 0; c < V; c += kChunk) {
        const int64_t stop = std::min(V, c + kChunk);
        int hit = 0;
#pragma omp simd reduction(|:hit)
        for (int64_t i = c; i < stop; ++i)
          hit |= nan ? (bits[i] & 0x7fffffffu) > 0x7f800000u : order_key(bits[i]) == best;
        if (!hit) continue;
        pick = c;
        while (nan ? (bits[pick] & 0x7fffffffu) <= 0x7f800000u : order_key(bits[pick]) != best)
          ++pick;
        break;
      }
      op[t] = pick;
    }
  });
  return out;
}
"""

_EMPTY = torch.empty(0)


def fused_kernels() -> Any | None:
    """The compiled module, or None where it cannot be built (logged once)."""
    return load_pooled_extension(
        "inference_engine_cpu_fused_v7", _SOURCE,
        ["rms_norm", "silu_and_mul", "rope_neox", "argmax_rows"],
        description="the CPU fused norm/activation kernels", extra_cflags=("-ffast-math",),
    )


def _usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight * s / rms(s), s)`` with ``s = x [+ residual]`` in one call, or None (use torch).

    ``x`` and ``residual`` are ``[T, D]`` or ``[T, H, D]`` with contiguous last dims (any
    other strides: column slices of a fused projection work without a copy); ``weight``
    is ``[D]`` or ``[P, D]``, where flattened row ``r`` uses ``weight[r % P]``
    (the q and k heads of a layer with their own weights). The second element
    is None without ``residual``.
    """
    if not _usable(x) or (residual is not None and not _usable(residual)):
        return None
    if weight is not None and not (weight.dtype == torch.float32 and weight.is_contiguous()):
        return None
    module = fused_kernels()
    if module is None:
        return None
    if x.dim() not in (2, 3) or (residual is not None and residual.shape != x.shape):
        return None
    rows = x.unsqueeze(1) if x.dim() == 2 else x  # [T, D] -> [T, 1, D]; [T, H, d] as it is
    res = residual.unsqueeze(1) if residual is not None and residual.dim() == 2 else residual
    out, total = module.rms_norm(rows, _EMPTY if weight is None else weight,
                                 _EMPTY if res is None else res, float(eps))
    return out.view(x.shape), (total.view(x.shape) if residual is not None else None)


def fused_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first), or None (use torch)."""
    if gate_up.dim() != 2 or not _usable(gate_up):
        return None
    module = fused_kernels()
    if module is None:
        return None
    return module.silu_and_mul(gate_up)


def fused_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """``x [T, H, D]`` with neox rotary applied from ``table [T, 2R]`` rows
    ``[cos | cos | -sin | sin]`` in one pass, or None (use torch)."""
    if x.dim() != 3 or not _usable(x) or not _usable(table) or table.dim() != 2:
        return None
    module = fused_kernels()
    if module is None:
        return None
    return module.rope_neox(x, table)


def fused_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` for float32 ``x [T, V]`` on CPU, or None (use torch).

    torch's CPU argmax is a scalar loop (~80 us for 16 x 8192 logits, a greedy
    decode step's pick); this is a vectorised max and a scan for its first index.
    """
    if x.dim() != 2 or not _usable(x) or x.shape[1] == 0:
        return None
    module = fused_kernels()
    if module is None:
        return None
    return module.argmax_rows(x)
