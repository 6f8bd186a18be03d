// Paged prefill attention read in place (inference_engine.builtin.attention.cpu_prefill_kernel).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "ie_parallel_tasks.h"
#include "ie_simd_helpers.h"

namespace {

using namespace ie_simd;

#ifdef IE_SIMD16
constexpr int64_t QUERY_SLICE = 32;  // query tokens per task
constexpr int RB = VECTOR_REGISTERS == 32 ? 8 : 4;  // score rows per register block

struct Task {
  int64_t seq, head, first_query;
};

// s[rr] = the scores of query rows r0 + rr (rr < RN, d floats apart from q) against the
// block's 16 keys (kt columns). RN is a template argument so the register block has no
// per-row test inside the loop over d (measured: about a fifth of the kernel's samples
// sat on those tests).
template <int RN, int NV>
inline void score_rows(const float* q, const float* kt, vf16* s) {
  constexpr int64_t d = NV * 16;
  for (int rr = 0; rr < RN; ++rr) s[rr] = vzero();
  for (int64_t e = 0; e < d; ++e) {
    const vf16 ke = vload(kt + e * 16);
    for (int rr = 0; rr < RN; ++rr) s[rr] = vfmadd(vset1(q[rr * d + e]), ke, s[rr]);
  }
}

// score_rows for a run-time rn in [1, N].
template <int N, int NV>
inline void score_rows_upto(int64_t rn, const float* q, const float* kt, vf16* s) {
  if (rn == N) {
    score_rows<N, NV>(q, kt, s);
  } else if constexpr (N > 1) {
    score_rows_upto<N - 1, NV>(rn, q, kt, s);
  }
}

// One task: query tokens [q0, q1) of sequence s (positions base + i), KV head h,
// all g query heads of it. q/out rows are [T, kvh, g, d]; NV = d / 16.
template <typename T, int NV>
void prefill_task(const float* q, float* out, const T* kc, const T* vc, const int64_t* table,
                  int64_t kb, int64_t kt, int64_t kh, int64_t vb, int64_t vt, int64_t vh,
                  int64_t bs, int64_t kvh, int64_t g, int64_t h, int64_t q0, int64_t q1,
                  int64_t base, int64_t window, float sc) {
  constexpr int64_t d = NV * 16;
  const int64_t nq = q1 - q0, rows = nq * g;
  thread_local std::vector<float> qs, acc, m, l, probs;
  qs.resize(rows * d);
  acc.assign(rows * d, 0.f);
  m.assign(rows, -std::numeric_limits<float>::infinity());
  l.assign(rows, 0.f);
  probs.resize(rows * 16);
  // Scaled queries, row r = query i * g + head j.
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const float* src = q + (((q0 + i) * kvh + h) * g + j) * d;
      float* dst = qs.data() + (i * g + j) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = src[e] * sc;
    }
  const int64_t last_pos = base + q1 - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, base + q0 - window + 1) : 0;
  alignas(64) float kt_tile[d * 16];
  for (int64_t b = first_key / bs; b * bs <= last_pos; ++b) {
    const int64_t t0 = b * bs;
    const int64_t nt = std::min<int64_t>(bs, last_pos + 1 - t0);
    const T* kblock = kc + table[b] * kb + h * kh;
    const T* vblock = vc + table[b] * vb + h * vh;
    // kt_tile[e][tt] = K[t0 + tt][e], zero past nt.
    for (int64_t tt = 0; tt < 16; ++tt) {
      if (tt < nt) {
        const T* krow = kblock + tt * kt;
        for (int64_t e = 0; e < d; ++e) kt_tile[e * 16 + tt] = to_float(krow[e]);
      } else {
        for (int64_t e = 0; e < d; ++e) kt_tile[e * 16 + tt] = 0.f;
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int64_t rn = std::min<int64_t>(RB, rows - r0);
      // Skip a register block whose rows all end before this key block.
      if (base + q0 + (r0 + rn - 1) / g < t0) continue;
      vf16 s[RB];
      score_rows_upto<RB, NV>(rn, qs.data() + r0 * d, kt_tile, s);
      for (int rr = 0; rr < rn; ++rr) {
        const int64_t r = r0 + rr;
        const int64_t pos = base + q0 + r / g;
        // Lane tt (key t0 + tt) is visible to this row when t0 + tt <= pos, within the window.
        const int64_t hi = std::min<int64_t>(nt, pos - t0 + 1);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - t0) : 0;
        float* pr = probs.data() + r * 16;
        if (hi <= lo) {
          std::fill(pr, pr + 16, 0.f);
          continue;
        }
        const mask16 mask = mask_bits(((1u << hi) - 1) & ~((1u << lo) - 1));
        online_softmax_step<NV>(s[rr], mask, m[r], l[r], pr, acc.data() + r * d);
      }
      // acc[r] += sum_tt p[r][tt] * V[t0 + tt], four rows at a time in registers.
      for (int64_t ra = r0; ra < r0 + rn; ra += 4)
        add_weighted_values<T, NV>(acc.data() + ra * d, d, probs.data() + ra * 16,
                                   std::min<int64_t>(4, r0 + rn - ra), vblock, vt, nt);
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = i * g + j;
      const float inv = 1.f / l[r];
      float* dst = out + (((q0 + i) * kvh + h) * g + j) * d;
      const float* ar = acc.data() + r * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = ar[e] * inv;
    }
}

template <typename T, int NV>
void prefill_all(const torch::Tensor& q, torch::Tensor& out, const torch::Tensor& k_cache,
                 const torch::Tensor& v_cache, const torch::Tensor& tables,
                 const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                 float sc, int64_t window) {
  const int64_t kvh = q.size(1), g = q.size(2);
  std::vector<Task> tasks;
  for (int64_t s = 0; s + 1 < (int64_t)starts.size(); ++s)
    for (int64_t i0 = starts[s]; i0 < starts[s + 1]; i0 += QUERY_SLICE)
      for (int64_t h = 0; h < kvh; ++h) tasks.push_back({s, h, i0});
  // Longest tasks (latest queries of long sequences) first, for balance.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    const int64_t pa = lens[a.seq] - (starts[a.seq + 1] - a.first_query);
    const int64_t pb = lens[b.seq] - (starts[b.seq + 1] - b.first_query);
    return pa > pb;
  });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t ts = tables.stride(0), bs = k_cache.size(1);
  parallel_tasks((int64_t)tasks.size(), [&](int64_t i) {
    const Task& task = tasks[i];
    const int64_t s = task.seq;
    const int64_t q1 = std::min<int64_t>(starts[s + 1], task.first_query + QUERY_SLICE);
    // Query row starts[s] + k sits at position lens[s] - (starts[s+1] - starts[s]) + k.
    const int64_t base = lens[s] - (starts[s + 1] - starts[s]) - starts[s];
    prefill_task<T, NV>(qp, op, kp, vp, tp + s * ts, k_cache.stride(0), k_cache.stride(1),
                        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
                        v_cache.stride(2), bs, kvh, g, task.head, task.first_query, q1, base,
                        window, sc);
  });
}
#endif

}  // namespace

bool available() {
#ifdef IE_SIMD16
  return true;
#else
  return false;
#endif
}

// q [T, kvh, g, d] float32 contiguous: the query rows of S sequences laid end to end
// (sequence s owns rows starts[s]..starts[s+1], the last of its lens[s] positions);
// caches [num_blocks, bs, kvh, d] float32 or bfloat16, rows contiguous, already holding
// these tokens' K/V; tables [S, max_blocks] int64. Returns [T, kvh, g, d] float32.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor tables, std::vector<int64_t> starts,
                            std::vector<int64_t> lens, double scale, int64_t window) {
  TORCH_CHECK(available(), "the CPU prefill kernel needs AVX-512 or AVX2 with FMA");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 4);
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(ct == v_cache.scalar_type() && (ct == torch::kFloat32 || ct == torch::kBFloat16),
              "caches must both be float32 or bfloat16");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1);
  TORCH_CHECK(k_cache.size(2) == q.size(1) && k_cache.size(3) == q.size(3));
  TORCH_CHECK(k_cache.size(1) <= 16, "block size at most 16");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.stride(1) == 1);
  TORCH_CHECK(starts.size() == lens.size() + 1 && (int64_t)lens.size() <= tables.size(0));
  TORCH_CHECK(starts.front() == 0 && starts.back() == q.size(0), "starts must cover q");
  const int64_t bs = k_cache.size(1);
  for (size_t s = 0; s < lens.size(); ++s) {
    const int64_t qlen = starts[s + 1] - starts[s];
    TORCH_CHECK(qlen >= 0 && qlen <= lens[s], "sequence ", s, ": more queries than positions");
    TORCH_CHECK((lens[s] + bs - 1) / bs <= tables.size(1), "sequence ", s, ": table too short");
  }
  auto out = torch::empty_like(q);
#ifdef IE_SIMD16
  const float sc = static_cast<float>(scale);
  const int64_t d = q.size(3);
#define IE_PREFILL(T, NV) \
  prefill_all<T, NV>(q, out, k_cache, v_cache, tables, starts, lens, sc, window)
  const bool f32 = ct == torch::kFloat32;
  switch (d) {
    case 32: if (f32) IE_PREFILL(float, 2); else IE_PREFILL(at::BFloat16, 2); break;
    case 48: if (f32) IE_PREFILL(float, 3); else IE_PREFILL(at::BFloat16, 3); break;
    case 64: if (f32) IE_PREFILL(float, 4); else IE_PREFILL(at::BFloat16, 4); break;
    case 96: if (f32) IE_PREFILL(float, 6); else IE_PREFILL(at::BFloat16, 6); break;
    case 128: if (f32) IE_PREFILL(float, 8); else IE_PREFILL(at::BFloat16, 8); break;
    case 256: if (f32) IE_PREFILL(float, 16); else IE_PREFILL(at::BFloat16, 16); break;
    default: TORCH_CHECK(false, "head size ", d, " has no CPU prefill kernel");
  }
#undef IE_PREFILL
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", torch::wrap_pybind_function(paged_prefill), "paged_prefill");
  m.def("available", torch::wrap_pybind_function(available), "available");
  m.def("set_parallel_runner", torch::wrap_pybind_function(set_parallel_runner),
        "set_parallel_runner");
}
