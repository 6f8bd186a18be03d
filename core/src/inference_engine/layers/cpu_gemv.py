"""CPU linear layers of bfloat16 checkpoints: a bf16 copy of the widened weights.

The CPU platform computes bfloat16 checkpoints in float32
(``Platform.compute_dtype``): activations, norms, attention and the KV cache
are float32, and each linear layer keeps an exact bfloat16 copy of its weight
(only made when every float32 value is a bfloat16 value) that it multiplies
from:

* decode-sized batches (up to :func:`gemv_max_rows` rows) go through the GEMV
  kernel below: it reads 2 bytes per weight, widens each 16-weight vector to
  float32 in registers and accumulates in float32, prefetching rows ahead;
* larger batches, on CPUs with a bf16 dot product (AVX512-BF16, AMX) and
  when bfloat16 was asked for (:func:`allow_bf16_gemm`), multiply with the
  activations rounded to bf16 (as llama.cpp and transformers compute bf16
  models): up to :data:`DPBF16_MAX_ROWS` rows in the ``gemm_dpbf16`` kernel
  below (``vdpbf16ps``, float32 sums and float32 results, run on the core's
  spinning thread pool: 6.9 against 9.5 ms for oneDNN over the benchmark
  model's 33 GEMMs at 64 rows under ``OMP_WAIT_POLICY=PASSIVE``), more rows
  in oneDNN's bf16 GEMM (results rounded to bf16); elsewhere, and for
  ``dtype=float32``, to MKL on the float32 weights.

Measured: on a 2-core Intel AVX-512 machine without bf16 instructions a whole
29M-weight decode sweep takes ~4 ms against ~12 ms for ``F.linear`` on the
float32 weights, and the kernel is faster up to 24 rows; on a 2-core AMD EPYC
with AVX512-BF16 the kernel is 2-3x faster than oneDNN's bf16 GEMM for one
row, even at 8 rows, and oneDNN's bf16 GEMM is ~3x faster than MKL's float32
one above that. The float32 weight stays (the reference path, and the MKL
path), so the copy costs half as much memory again as the float32 weights.

AVX-512 only (other CPUs keep ``F.linear``); ``INFERENCE_ENGINE_CPU_KERNELS=0``
turns it off. ``F.linear`` in float64 is the reference it is tested against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inference_engine.builtin.platforms import cpu as cpu_platform
from inference_engine.cpu_thread_pool import load_pooled_extension

__all__ = ["DPBF16_MAX_ROWS", "GEMV_MAX_ROWS", "NATIVE_BF16_GEMV_MAX_ROWS", "allow_bf16_gemm", "bf16_gemv_weight",
           "gemv_kernel", "gemv_max_rows", "small_batch_linear"]

GEMV_MAX_ROWS = 24
"""Largest number of activation rows sent to the kernel instead of MKL's float32 GEMM."""
NATIVE_BF16_GEMV_MAX_ROWS = 8
"""The same limit where oneDNN's bf16 GEMM (a CPU with a bf16 dot product) is the alternative."""
DPBF16_MAX_ROWS = 320
"""Most rows for the AVX512-BF16 kernel on the spinning pool; oneDNN's bf16 GEMM above."""

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

PARALLEL_TASKS

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
  // Tasks of ~32K weights (64 KB read), claimed one by one, so a thread that
  // starts late or is descheduled takes fewer; small matrices stay on one thread.
  const int64_t per_task = std::max<int64_t>(1, 32768 / (NR * std::max<int64_t>(K, 1)));
  const int64_t ntasks = (blocks + per_task - 1) / per_task;
  parallel_tasks(ntasks, [&](int64_t task) {
    const int64_t b1 = std::min(blocks, (task + 1) * per_task);
    for (int64_t b = task * per_task; b < b1; ++b) {
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
#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {
// y[m, n..n+4) for MR activation rows, from bf16 x (rows K apart) and bf16 w (rows K
// apart); each vdpbf16ps multiplies 32 pairs exactly and adds them in float32.
template <int MR>
void dp_tile(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t K, int64_t N) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[4];
    for (int r = 0; r < 4; ++r)
      wv[r] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + r * K + k));
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * K + k));
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if constexpr (MR == 4) {
    // Lane 4m + r of the result is the sum of acc[m][r]: one transposing reduction
    // for the whole tile instead of 16 horizontal sums.
    __m512 v[8], u[4];
    for (int i = 0; i < 8; ++i) {
      const __m512 a = acc[i / 2][(2 * i) % 4], b = acc[i / 2][(2 * i) % 4 + 1];
      v[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
      u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                     _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                     _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88),
                                     _mm512_shuffle_f32x4(s01, s23, 0xDD));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, sum);
    for (int m = 0; m < 4; ++m)
      for (int r = 0; r < 4; ++r) y[m * N + r] = lanes[4 * m + r];
  } else {
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < 4; ++r) y[m * N + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
}
}  // namespace
#endif

bool has_dpbf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 contiguous (rounded to bf16 here, to nearest even), w [N, K] bfloat16
// contiguous, K % 32 == 0 and N % 4 == 0 -> y [M, N] float32 (+ bias), float32 sums.
torch::Tensor gemm_dpbf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_dpbf16(), "the bf16 dot-product GEMM needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && N % 4 == 0, "shapes: K % 32, N % 4");
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  auto xb = torch::empty({M, K}, w.options());
  const float* xp = x.data_ptr<float>();
  at::BFloat16* xbp = xb.data_ptr<at::BFloat16>();
  auto convert = [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * K; i < r1 * K; i += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + i + 16), _mm512_loadu_ps(xp + i));
      _mm512_storeu_si512(reinterpret_cast<void*>(xbp + i), (__m512i)h);
    }
  };
  const int64_t conv_rows = std::max<int64_t>(1, 16384 / K);  // ~64 KB of float32 per task
  if (M <= conv_rows) {
    convert(0, M);
  } else {
    parallel_tasks((M + conv_rows - 1) / conv_rows, [&](int64_t task) {
      convert(task * conv_rows, std::min(M, (task + 1) * conv_rows));
    });
  }
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / 4;
  // Tasks of ~32K weights: the tile stays in L1 while the activation rows of one
  // row slice (at most ~128 KB of them, so they stay in L2) pass over it.
  const int64_t per_task = std::max<int64_t>(1, 32768 / (4 * K));
  const int64_t ntasks = (blocks + per_task - 1) / per_task;
  const int64_t slice = std::max<int64_t>(4, (65536 / K) / 4 * 4);
  const int64_t nslices = (M + slice - 1) / slice;
  parallel_tasks(ntasks * nslices, [&](int64_t job) {
    const int64_t task = job % ntasks, m0 = (job / ntasks) * slice;
    const int64_t m1 = std::min(M, m0 + slice);
    const int64_t b1 = std::min(blocks, (task + 1) * per_task);
    for (int64_t b = task * per_task; b < b1; ++b) {
      const int64_t n = b * 4;
      int64_t m = m0;
      for (; m + 4 <= m1; m += 4) dp_tile<4>(xbp + m * K, wp + n * K, yp + m * N + n, K, N);
      for (; m < m1; ++m) dp_tile<1>(xbp + m * K, wp + n * K, yp + m * N + n, K, N);
    }
  });
#endif
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}
"""

def gemv_kernel() -> Any | None:
    """The compiled module, or None where it cannot be built or the CPU lacks AVX-512."""
    module = load_pooled_extension(
        "inference_engine_cpu_gemv_v6", _SOURCE, ["gemv", "available", "gemm_dpbf16", "has_dpbf16"],
        description="the CPU bf16 GEMV kernel",
    )
    if module is None or not module.available():
        return None
    return module


def gemv_max_rows() -> int:
    """Rows up to which the GEMV kernel beats this CPU's GEMM."""
    return NATIVE_BF16_GEMV_MAX_ROWS if cpu_platform.has_native_bf16() else GEMV_MAX_ROWS


def bf16_gemv_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A contiguous bfloat16 copy of a float32 CPU ``[N, K]`` weight, or None.

    None unless the copy is exact (every value is a bfloat16 value, as it is
    for a bfloat16 checkpoint widened to float32) and something uses it: the
    kernel, or the CPU's bf16 GEMM.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if gemv_kernel() is None and not cpu_platform.has_native_bf16():
        return None
    copy = weight.detach().to(torch.bfloat16).contiguous()
    if not torch.equal(copy.to(torch.float32), weight):
        return None
    return copy


def allow_bf16_gemm(model: torch.nn.Module) -> None:
    """Let the layers of a model loaded as bfloat16 multiply large batches in bf16."""
    for module in model.modules():
        if getattr(module, "gemv_weight", None) is not None:
            module.bf16_gemm = True


def _dpbf16_fits(weight: torch.Tensor) -> bool:
    return weight.shape[1] % 32 == 0 and weight.shape[0] % 4 == 0


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, gemv_weight: torch.Tensor | None,
                       bias: torch.Tensor | None = None, *,
                       bf16_gemm: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 ``x``, from the bf16 copy where there is one.

    A few rows go through the kernel; more go, with ``bf16_gemm`` on a CPU
    with a bf16 dot product, to its bf16 GEMM (activations and products
    rounded to bf16, as a bf16 model computes), else to ``F.linear`` on the
    float32 weight.
    """
    if gemv_weight is None or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if x.dim() == 2 and 0 < x.shape[0] <= gemv_max_rows():
        module = gemv_kernel()
        if module is not None:
            return module.gemv(x.contiguous(), gemv_weight, bias)
    if bf16_gemm and cpu_platform.has_native_bf16():
        if x.dim() == 2 and x.shape[0] <= DPBF16_MAX_ROWS and _dpbf16_fits(gemv_weight):
            module = gemv_kernel()
            if module is not None and module.has_dpbf16():
                return module.gemm_dpbf16(x.contiguous(), gemv_weight, bias)
        out = F.linear(x.to(torch.bfloat16), gemv_weight).float()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
