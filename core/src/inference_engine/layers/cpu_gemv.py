"""Small-batch linear layers on CPU from bfloat16 weights widened in registers.

Decoding a few sequences multiplies a handful of activation rows by every
weight matrix, so a decode step costs one read of all the weights. CPUs
without a bfloat16 dot product compute bfloat16 checkpoints in float32
(``Platform.compute_dtype``), and oneDNN/MKL then stream 4 bytes per weight.
This kernel reads a bfloat16 copy (2 bytes per weight, exact: it is only made
when every float32 value is a bfloat16 value), widens each 16-weight vector to
float32 in registers and accumulates in float32, prefetching the rows ahead.
Measured on the 2-core development machine: a whole 29M-weight decode sweep
in ~4 ms against ~12 ms for ``F.linear`` on the float32 weights (one row), and
faster up to 24 rows; above :data:`GEMV_MAX_ROWS` MKL's float32 GEMM wins and
is used. The float32 weight stays for that path, so the copy costs half as
much memory again as the float32 weights.

AVX-512 only (other CPUs keep ``F.linear``); ``INFERENCE_ENGINE_CPU_KERNELS=0``
turns it off. ``F.linear`` on the float32 weights is the reference it is tested
against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inference_engine.cpu_extensions import load_cpu_extension

__all__ = ["GEMV_MAX_ROWS", "bf16_gemv_weight", "gemv_kernel", "small_batch_linear"]

GEMV_MAX_ROWS = 24
"""Largest number of activation rows sent to the kernel instead of MKL."""

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

bool available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512F__
namespace {
constexpr int NR = 4;        // weight rows per micro-tile
constexpr int PREFETCH = 8;  // rows ahead to prefetch (measured best of 4 / 8 / 16)

inline __m512 widen(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline float scalar(const at::BFloat16* p) { return static_cast<float>(*p); }

// y[m, n..n+NR) for m < MR: x rows are K floats apart, y rows N apart, w rows K apart.
template <int MR>
void tile(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N) {
  __m512 acc[MR][NR], acc2[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = acc2[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const at::BFloat16* row = w + r * K + k;
      const __m512 w0 = widen(row), w1 = widen(row + 16);
      _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH * K), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        // Two chains per output when few rows leave registers free (FMA latency).
        acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, acc[m][r]);
        if constexpr (MR <= 2)
          acc2[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), w1, acc2[m][r]);
        else
          acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), w1, acc[m][r]);
      }
    }
  }
  for (; k + 16 <= K; k += 16)
    for (int r = 0; r < NR; ++r) {
      const __m512 w0 = widen(w + r * K + k);
      for (int m = 0; m < MR; ++m)
        acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, acc[m][r]);
    }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][r], acc2[m][r]));
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * scalar(w + r * K + kk);
      y[m * N + r] = s;
    }
}

// Rows of w that do not fill a micro-tile.
void rest(const float* x, const at::BFloat16* w, float* y, int64_t M, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t kk = 0; kk < K; ++kk) s += x[m * K + kk] * scalar(w + n * K + kk);
      y[m * N + n] = s;
    }
}
}  // namespace
#endif

// x [M, K] float32 contiguous, w [N, K] bfloat16 contiguous -> y [M, N] float32 (+ bias [N]).
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(available(), "the bf16 GEMV kernel needs AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
#ifdef __AVX512F__
  const float* xp = x.data_ptr<float>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / NR;
  // ~16K weights per task at least, so small matrices do not wake every thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / (NR * std::max<int64_t>(K, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NR;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<4>(xp + m * K, wp + n * K, yp + m * N + n, K, N);
      for (; m + 2 <= M; m += 2) tile<2>(xp + m * K, wp + n * K, yp + m * N + n, K, N);
      for (; m < M; ++m) tile<1>(xp + m * K, wp + n * K, yp + m * N + n, K, N);
    }
  });
  rest(xp, wp, yp, M, K, N, blocks * NR, N);
#endif
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}
"""


def gemv_kernel() -> Any | None:
    """The compiled module, or None where it cannot be built or the CPU lacks AVX-512."""
    module = load_cpu_extension(
        "inference_engine_cpu_gemv_v1", _SOURCE, ["gemv", "available"],
        description="the CPU bf16 GEMV kernel",
    )
    if module is None or not module.available():
        return None
    return module


def bf16_gemv_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A contiguous bfloat16 copy of a float32 CPU ``[N, K]`` weight, or None.

    None unless the kernel is available and the copy is exact (every value is
    a bfloat16 value, as it is for a bfloat16 checkpoint widened to float32),
    so the kernel never changes what the model computes beyond float32
    summation order.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if gemv_kernel() is None:
        return None
    copy = weight.detach().to(torch.bfloat16).contiguous()
    if not torch.equal(copy.to(torch.float32), weight):
        return None
    return copy


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, gemv_weight: torch.Tensor | None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the bf16 kernel for a few float32 rows."""
    if (gemv_weight is not None and x.dtype == torch.float32 and x.dim() == 2
            and 0 < x.shape[0] <= GEMV_MAX_ROWS):
        module = gemv_kernel()
        if module is not None:
            return module.gemv(x.contiguous(), gemv_weight, bias)
    return F.linear(x, weight, bias)
