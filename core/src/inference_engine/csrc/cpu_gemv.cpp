// bf16-weight GEMV and packed bf16 GEMM for float32 activations (inference_engine.layers.cpu_gemv).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <type_traits>
#include <algorithm>
#include <map>
#include <string>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "ie_parallel_tasks.h"
#include "ie_simd_helpers.h"

// The kernels exist for AVX-512F (16-float vectors) and for AVX2 with FMA (8-float
// vectors, fewer registers: smaller tiles); elsewhere available() is false.
#if defined(__AVX512F__)
#define IE_GEMV_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define IE_GEMV_AVX2 1
#endif
#if defined(IE_GEMV_AVX512) || defined(IE_GEMV_AVX2)
#define IE_GEMV_SIMD 1
#endif

bool available() {
#ifdef IE_GEMV_SIMD
  return true;
#else
  return false;
#endif
}

#ifdef IE_GEMV_SIMD
namespace {
inline float scalar(const at::BFloat16* p) { return static_cast<float>(*p); }

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

#ifdef __AVX512F__
namespace {
constexpr int NR = 4;        // weight rows per micro-tile
constexpr int PREFETCH = 8;  // rows ahead to prefetch (measured best of 4 / 8 / 16)

inline __m512 widen(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

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

}  // namespace
#elif defined(IE_GEMV_AVX2)
namespace {
constexpr int NR = 4;        // weight rows per micro-tile
constexpr int PREFETCH = 8;  // rows ahead to prefetch

using ie_simd::hsum8;   // ie_simd_helpers.h
using ie_simd::widen8;

// y[m, n..n+NR) for m < MR (1 or 2: sixteen 8-float registers hold MR * NR * 2 sums
// and the widened weights): x rows are K floats apart, y rows N apart, w rows K apart.
template <int MR>
void tile(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N) {
  __m256 acc[MR][NR], acc2[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = acc2[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const at::BFloat16* row = w + r * K + k;
      const __m256 w0 = widen8(row), w1 = widen8(row + 8);
      if ((k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH * K), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int m = 0; m < MR; ++m) {
        acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, acc[m][r]);
        acc2[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), w1, acc2[m][r]);
      }
    }
  }
  for (; k + 8 <= K; k += 8)
    for (int r = 0; r < NR; ++r) {
      const __m256 w0 = widen8(w + r * K + k);
      for (int m = 0; m < MR; ++m)
        acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, acc[m][r]);
    }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = hsum8(_mm256_add_ps(acc[m][r], acc2[m][r]));
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * scalar(w + r * K + kk);
      y[m * N + r] = s;
    }
}

}  // namespace
#endif

// x [M, K] float32 contiguous, w [N, K] bfloat16 contiguous -> y [M, N] float32 (+ bias [N]).
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(available(), "the bf16 GEMV kernel needs AVX-512 or AVX2 with FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
#ifdef IE_GEMV_SIMD
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
#ifdef IE_GEMV_AVX512
      for (; m + 4 <= M; m += 4) tile<4>(xp + m * K, wp + n * K, yp + m * N + n, K, N);
#endif
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

#ifdef IE_GEMV_SIMD
namespace {
#ifdef IE_GEMV_AVX512
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
#else
// The AVX2 form: a group's 16 columns are two 8-float halves, so a pair of k is two
// 32-byte loads giving four widened vectors (even/odd k of columns 0-7 and 8-15).
// MR * NR * 2 sums must fit in sixteen registers beside the weights: callers keep
// MR * NR <= 4.
template <int MR, int NR>
void fma_micro(const float* x, int64_t ldx, int64_t K, const at::BFloat16* w, int64_t gs,
               float* y, int64_t N) {
  __m256 lo[MR][NR], hi8[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) lo[m][n] = hi8[m][n] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
  for (int64_t p = 0; p < K / 2; ++p) {
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) {
      const at::BFloat16* wp = w + n * gs + p * 32;
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(r0, 16));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(r0, hi));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(r1, 16));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(r1, hi));
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m256 x0 = _mm256_broadcast_ss(x + m * ldx + 2 * p);
        const __m256 x1 = _mm256_broadcast_ss(x + m * ldx + 2 * p + 1);
        lo[m][n] = _mm256_fmadd_ps(x1, o0, _mm256_fmadd_ps(x0, e0, lo[m][n]));
        hi8[m][n] = _mm256_fmadd_ps(x1, o1, _mm256_fmadd_ps(x0, e1, hi8[m][n]));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      _mm256_storeu_ps(y + m * N + 16 * n, lo[m][n]);
      _mm256_storeu_ps(y + m * N + 16 * n + 8, hi8[m][n]);
    }
}
#endif

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

// y [M, N] = x [M, K] (row stride ldx) times packed w [N/16, K/2, 16, 2] (pack_bf16),
// plus bias [N] where not null: float32 multiply-adds of the exact widened weights. The
// body of gemv_packed on plain pointers, for kernels that chain it without Python
// (csrc/cpu_decode_step.cpp reaches it through entry_points()).
extern "C" void ie_gemv_packed_raw(const float* xp, int64_t ldx, int64_t M, int64_t K,
                                   const at::BFloat16* wp, int64_t groups, const float* bias,
                                   float* yp) {
  const int64_t N = groups * 16;
#if defined(IE_GEMV_AVX512)
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
#elif defined(IE_GEMV_AVX2)
  const int64_t gs = K * 16;
  packed_tasks(M, groups, 8, [&](int64_t m0, int64_t m1, int64_t g0, int64_t gn) {
    const at::BFloat16* wg = wp + g0 * gs;
    if (m1 - m0 == 1) {  // one row: the task's (up to) four groups side by side
      with_groups(gn, [&](auto nr) {
        fma_micro<1, decltype(nr)::value>(xp + m0 * ldx, ldx, K, wg, gs, yp + m0 * N + g0 * 16, N);
      });
      return;
    }
    for (int64_t g = 0; g < gn; ++g)  // more rows: up to four rows of one group at a time
      row_tiles<4, 1>(m1 - m0, [&](auto mr, int64_t m) {
        fma_micro<decltype(mr)::value, 1>(xp + (m0 + m) * ldx, ldx, K, wg + g * gs, gs,
                                          yp + (m0 + m) * N + (g0 + g) * 16, N);
      });
  });
#endif
  if (bias != nullptr) {
    for (int64_t m = 0; m < M; ++m) {
      float* y = yp + m * N;
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) y[n] += bias[n];
    }
  }
}

// x [M, K] float32 (rows contiguous), packed w (pack_bf16) -> y [M, N] float32 (+ bias),
// float32 multiply-adds of the exact widened weights: the decode-sized GEMV.
torch::Tensor gemv_packed(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(available(), "the bf16 GEMV kernel needs AVX-512 or AVX2 with FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), groups = w.size(0), N = groups * 16;
  TORCH_CHECK(w.size(1) * 2 == K, "x and w disagree on K");
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == N, "bias has ", b.numel(), " values for ", N, " outputs");
  }
  ie_gemv_packed_raw(x.data_ptr<float>(), x.stride(0), M, K, w.data_ptr<at::BFloat16>(), groups,
                     bias.has_value() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", torch::wrap_pybind_function(gemv), "gemv");
  m.def("available", torch::wrap_pybind_function(available), "available");
  m.def("pack_bf16", torch::wrap_pybind_function(pack_bf16), "pack_bf16");
  m.def("gemv_packed", torch::wrap_pybind_function(gemv_packed), "gemv_packed");
  m.def("gemm_packed", torch::wrap_pybind_function(gemm_packed), "gemm_packed");
  m.def("has_dpbf16", torch::wrap_pybind_function(has_dpbf16), "has_dpbf16");
  m.def("entry_points", []() {
    return std::map<std::string, int64_t>{
        {"gemv_packed", reinterpret_cast<int64_t>(&ie_gemv_packed_raw)}};
  }, "addresses of the plain-pointer kernels");
  m.def("set_parallel_runner", torch::wrap_pybind_function(set_parallel_runner),
        "set_parallel_runner");
}
