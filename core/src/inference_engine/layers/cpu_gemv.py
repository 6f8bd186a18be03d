"""CPU linear layers of bfloat16 checkpoints: a bf16 copy of the widened weights.

The CPU platform computes bfloat16 checkpoints in float32
(``Platform.compute_dtype``): activations, norms and attention are float32
(the KV cache stays bfloat16, ``--kv-cache-dtype auto``), and each linear
layer keeps an exact bfloat16 copy of its weight
(only made when every float32 value is a bfloat16 value) that it multiplies
from:

* every copy whose shape allows it (``N % 16 == 0``, even ``K``) is *packed*,
  ``[N/16, K/2, 16, 2]``: one 64-byte vector per 16 output columns and pair of
  ``k``, so outputs accumulate 16 columns per register with no horizontal sums,
  and a pair is exactly what ``vdpbf16ps`` multiplies;
* decode-sized batches (up to :func:`gemv_max_rows` rows) go through a GEMV
  kernel: it reads 2 bytes per weight, widens them to float32 in registers
  and accumulates float32 activations in float32;
* larger batches, on CPUs with a bf16 dot product (AVX512-BF16, AMX) and
  when bfloat16 was asked for (:func:`allow_bf16_gemm`), multiply with the
  activations rounded to bf16 (as llama.cpp and transformers compute bf16
  models) in the packed ``vdpbf16ps`` kernel on the core's spinning pool,
  float32 sums and results (over the benchmark model's 33 GEMMs: 4.7 against
  8.8 ms for oneDNN plus the conversions at 64 rows, 145 against 191 ms at
  2048, under ``OMP_WAIT_POLICY=PASSIVE``); a row-major copy (a shape the
  packing does not take) uses oneDNN's bf16 GEMM instead. Elsewhere, and for
  ``dtype=float32``, MKL's GEMM on the float32 weights.

Measured: on a 2-core Intel AVX-512 machine without bf16 instructions a whole
29M-weight decode sweep takes ~4 ms against ~12 ms for ``F.linear`` on the
float32 weights, and the kernel is faster up to 24 rows; on a 2-core AMD EPYC
with AVX512-BF16 it is 2-3x faster than oneDNN's bf16 GEMM for one row. The
float32 weight stays (the reference path, and the MKL path), so the copy
costs half as much memory again as the float32 weights.

AVX-512 only (other CPUs keep ``F.linear``); ``INFERENCE_ENGINE_CPU_KERNELS=0``
turns it off. ``F.linear`` in float64 is the reference it is tested against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inference_engine.builtin.platforms import cpu as cpu_platform
from inference_engine.cpu_thread_pool import load_pooled_extension

__all__ = ["GEMV_MAX_ROWS", "NATIVE_BF16_GEMV_MAX_ROWS", "allow_bf16_gemm", "bf16_gemv_weight",
           "gemv_kernel", "gemv_max_rows", "is_packed", "small_batch_linear", "unpack_bf16"]

GEMV_MAX_ROWS = 24
"""Largest number of activation rows sent to the kernel instead of MKL's float32 GEMM."""
NATIVE_BF16_GEMV_MAX_ROWS = 8
"""The same limit where oneDNN's bf16 GEMM (a CPU with a bf16 dot product) is the alternative."""

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <type_traits>
#include <algorithm>
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
// ---- Packed weights: [N/16][K/2][16][2] bf16, one 64-byte vector per 16 output
// columns and pair of k: lane j holds (w[16g + j][2p], w[16g + j][2p + 1]). Outputs
// accumulate 16 columns per register, so no horizontal sums are needed, and a
// pair is what vdpbf16ps multiplies.

// w [N, K] bfloat16 contiguous, N % 16 == 0, K % 2 == 0 -> packed [N/16, K/2, 16, 2].
torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "packing needs N % 16 == 0 and K % 2 == 0");
  auto out = torch::empty({N / 16, K / 2, 16, 2}, w.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t p = 0; p < K / 2; ++p)
        for (int64_t j = 0; j < 16; ++j)
          dst[(g * (K / 2) + p) * 16 + j] = src[(16 * g + j) * (K / 2) + p];
  });
  return out;
}

#ifdef __AVX512F__
namespace {
// y[0..MR) x [16 * NR columns] over all of K, float32 activations (rows ldx apart) and
// widened bf16 weights: w[2p] is the pair's low half shifted up, w[2p+1] its high half.
template <int MR, int NR>
void fma_micro(const float* x, int64_t ldx, int64_t K, const at::BFloat16* w, int64_t gs,
               float* y, int64_t N) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512 even[NR], odd[NR];
    for (int n = 0; n < NR; ++n) {
      const __m512i raw = _mm512_loadu_si512(w + n * gs + p * 32);
      even[n] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      odd[n] = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 x0 = _mm512_set1_ps(x[m * ldx + 2 * p]);
      const __m512 x1 = _mm512_set1_ps(x[m * ldx + 2 * p + 1]);
      for (int n = 0; n < NR; ++n)
        acc[m][n] = _mm512_fmadd_ps(x1, odd[n], _mm512_fmadd_ps(x0, even[n], acc[m][n]));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) _mm512_storeu_ps(y + m * N + 16 * n, acc[m][n]);
}

#ifdef __AVX512BF16__
// The same with bf16 activations (rows K apart): one vdpbf16ps per pair.
template <int MR, int NR>
void dp_micro(const at::BFloat16* x, int64_t K, const at::BFloat16* w, int64_t gs, float* y,
              int64_t N) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  const int32_t* xi = reinterpret_cast<const int32_t*>(x);
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(w + n * gs + p * 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xi[m * (K / 2) + p]);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) _mm512_storeu_ps(y + m * N + 16 * n, acc[m][n]);
}
#endif

// Rows [0, M) of one column block of NR groups, MR rows at a time.
template <int MAXR, int NR, class Micro>
void row_tiles(int64_t M, const Micro& micro) {
  int64_t m = 0;
  for (; m + MAXR <= M; m += MAXR) micro(std::integral_constant<int, MAXR>{}, m);
  switch (M - m) {
    case 5: if constexpr (MAXR > 5) micro(std::integral_constant<int, 5>{}, m); break;
    case 4: if constexpr (MAXR > 4) micro(std::integral_constant<int, 4>{}, m); break;
    case 3: micro(std::integral_constant<int, 3>{}, m); break;
    case 2: micro(std::integral_constant<int, 2>{}, m); break;
    case 1: micro(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// f(std::integral_constant<int, NR>{}) for a column block of gn (1..4) groups.
template <class F>
void with_groups(int64_t gn, const F& f) {
  switch (gn) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// Tasks of 4 column groups (64 outputs) x a slice of rows, on the spinning pool;
// tile(rows m0..m1, first group g0, groups gn) does the work.
template <class Tile>
void packed_tasks(int64_t M, int64_t groups, int64_t slice, const Tile& tile) {
  constexpr int64_t per = 4;
  const int64_t ncol = (groups + per - 1) / per;
  const int64_t nslices = (M + slice - 1) / slice;
  // Consecutive jobs share a column block (its weights stay in cache across slices).
  parallel_tasks(ncol * nslices, [&](int64_t job) {
    const int64_t c = job / nslices, m0 = (job % nslices) * slice;
    const int64_t g0 = c * per;
    tile(m0, std::min(M, m0 + slice), g0, std::min(per, groups - g0));
  });
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

// x [M, K] float32 (rows contiguous), packed w (pack_bf16) -> y [M, N] float32 (+ bias),
// float32 multiply-adds of the exact widened weights: the decode-sized GEMV.
torch::Tensor gemv_packed(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(available(), "the bf16 GEMV kernel needs AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), groups = w.size(0), N = groups * 16;
  TORCH_CHECK(w.size(1) * 2 == K, "x and w disagree on K");
  auto y = torch::empty({M, N}, x.options());
#ifdef __AVX512F__
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t gs = K * 16;
  packed_tasks(M, groups, 8, [&](int64_t m0, int64_t m1, int64_t g0, int64_t gn) {
    const at::BFloat16* wg = wp + g0 * gs;
    float* yo = yp + g0 * 16;
    with_groups(gn, [&](auto nr) {
      row_tiles<4, decltype(nr)::value>(m1 - m0, [&](auto mr, int64_t m) {
        fma_micro<decltype(mr)::value, decltype(nr)::value>(
            xp + (m0 + m) * ldx, ldx, K, wg, gs, yo + (m0 + m) * N, N);
      });
    });
  });
#endif
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}

// x [M, K] float32 contiguous (rounded to bf16 here, to nearest even), packed w ->
// y [M, N] float32 (+ bias): vdpbf16ps products summed in float32, any M.
torch::Tensor gemm_packed(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(has_dpbf16(), "the bf16 dot-product GEMM needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), groups = w.size(0), N = groups * 16;
  TORCH_CHECK(w.size(1) * 2 == K, "x and w disagree on K");
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  auto xb = torch::empty({M, K}, w.options());
  const float* xp = x.data_ptr<float>();
  at::BFloat16* xbp = xb.data_ptr<at::BFloat16>();
  const int64_t conv_rows = std::max<int64_t>(1, 16384 / K);  // ~64 KB of float32 per task
  auto convert = [&](int64_t task) {
    const int64_t end = std::min(M, (task + 1) * conv_rows) * K;
    int64_t i = task * conv_rows * K;
    for (; i + 32 <= end; i += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + i + 16), _mm512_loadu_ps(xp + i));
      _mm512_storeu_si512(reinterpret_cast<void*>(xbp + i), (__m512i)h);
    }
    for (; i < end; ++i) xbp[i] = at::BFloat16(xp[i]);
  };
  const int64_t conv_tasks = (M + conv_rows - 1) / conv_rows;
  if (conv_tasks == 1) convert(0); else parallel_tasks(conv_tasks, convert);
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t gs = K * 16;
  // Row slices of ~128 KB of bf16 activations stay in L2 while a column block passes.
  const int64_t slice = std::max<int64_t>(6, (65536 / K) / 6 * 6);
  packed_tasks(M, groups, slice, [&](int64_t m0, int64_t m1, int64_t g0, int64_t gn) {
    const at::BFloat16* wg = wp + g0 * gs;
    float* yo = yp + g0 * 16;
    with_groups(gn, [&](auto nr) {
      row_tiles<6, decltype(nr)::value>(m1 - m0, [&](auto mr, int64_t m) {
        dp_micro<decltype(mr)::value, decltype(nr)::value>(
            xbp + (m0 + m) * K, K, wg, gs, yo + (m0 + m) * N, N);
      });
    });
  });
#endif
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}
"""

def gemv_kernel() -> Any | None:
    """The compiled module, or None where it cannot be built or the CPU lacks AVX-512."""
    module = load_pooled_extension(
        "inference_engine_cpu_gemv_v10", _SOURCE,
        ["gemv", "available", "pack_bf16", "gemv_packed", "gemm_packed", "has_dpbf16"],
        description="the CPU bf16 GEMV kernel",
    )
    if module is None or not module.available():
        return None
    return module


def gemv_max_rows() -> int:
    """Rows up to which the GEMV kernel beats this CPU's GEMM."""
    return NATIVE_BF16_GEMV_MAX_ROWS if cpu_platform.has_native_bf16() else GEMV_MAX_ROWS


def bf16_gemv_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An exact bfloat16 copy of a float32 CPU ``[N, K]`` weight, or None.

    Packed (:func:`is_packed`, ``[N/16, K/2, 16, 2]``, the kernels' layout) where
    the kernel is built and ``N % 16 == 0`` and ``K`` is even; otherwise a
    contiguous ``[N, K]`` copy. None unless the copy is exact (every value is a
    bfloat16 value, as it is for a bfloat16 checkpoint widened to float32) and
    something uses it: the kernels, or the CPU's bf16 GEMM.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    module = gemv_kernel()
    if module is None and not cpu_platform.has_native_bf16():
        return None
    copy = weight.detach().to(torch.bfloat16).contiguous()
    if not torch.equal(copy.to(torch.float32), weight):
        return None
    if module is not None and copy.shape[0] % 16 == 0 and copy.shape[1] % 2 == 0:
        return module.pack_bf16(copy)
    return copy


def is_packed(gemv_weight: torch.Tensor) -> bool:
    """Whether a :func:`bf16_gemv_weight` copy is in the kernels' packed layout."""
    return gemv_weight.dim() == 4


def unpack_bf16(gemv_weight: torch.Tensor) -> torch.Tensor:
    """The ``[N, K]`` bfloat16 matrix of a :func:`bf16_gemv_weight` copy (either layout)."""
    if not is_packed(gemv_weight):
        return gemv_weight
    groups, pairs = gemv_weight.shape[:2]
    return gemv_weight.permute(0, 2, 1, 3).reshape(groups * 16, pairs * 2)


def allow_bf16_gemm(model: torch.nn.Module) -> None:
    """Let the layers of a model loaded as bfloat16 multiply large batches in bf16."""
    for module in model.modules():
        if getattr(module, "gemv_weight", None) is not None:
            module.bf16_gemm = True


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, gemv_weight: torch.Tensor | None,
                       bias: torch.Tensor | None = None, *,
                       bf16_gemm: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 ``x``, from the bf16 copy where there is one.

    Up to :func:`gemv_max_rows` rows go through the GEMV kernel (float32
    activations); more go, with ``bf16_gemm`` on a CPU with a bf16 dot
    product, to the packed ``vdpbf16ps`` kernel (activations rounded to bf16,
    as a bf16 model computes; float32 sums) or, for an unpacked copy, to
    oneDNN's bf16 GEMM; else to ``F.linear`` on the float32 weight.
    """
    if gemv_weight is None or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    packed = is_packed(gemv_weight)
    if x.dim() == 2 and 0 < x.shape[0] <= gemv_max_rows():
        module = gemv_kernel()
        if module is not None:
            if packed:
                return module.gemv_packed(x if x.stride(-1) == 1 else x.contiguous(),
                                          gemv_weight, bias)
            return module.gemv(x.contiguous(), gemv_weight, bias)
    if bf16_gemm and cpu_platform.has_native_bf16():
        module = gemv_kernel()
        if packed and x.dim() == 2 and module is not None and module.has_dpbf16():
            return module.gemm_packed(x.contiguous(), gemv_weight, bias)
        out = F.linear(x.to(torch.bfloat16), unpack_bf16(gemv_weight)).float()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
