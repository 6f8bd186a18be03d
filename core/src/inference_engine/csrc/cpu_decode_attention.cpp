// Paged decode attention read in place, and the cache write
// (inference_engine.builtin.attention.cpu_decode_kernel).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>
#include "ie_parallel_tasks.h"
#include "ie_simd_helpers.h"

namespace {

using namespace ie_simd;

constexpr int64_t PREFETCH_AHEAD = 1;  // blocks fetched ahead of the next (measured best of 1/2/3)

// Where token t's row of KV head 0 lies in a block-contiguous cache.
template <typename T>
struct Rows {
  const T* base;
  const int64_t* table;
  int64_t block_stride, token_stride, bs;
  inline const T* row(int64_t t) const {
    return base + table[t / bs] * block_stride + (t % bs) * token_stride;
  }
  // Prefetch block index b's rows (all heads) of this cache into L2.
  inline void prefetch_block(int64_t b, int64_t num_blocks) const {
#ifdef IE_SIMD16
    if (b >= num_blocks) return;
    const char* p = reinterpret_cast<const char*>(base + table[b] * block_stride);
    const int64_t bytes = bs * token_stride * (int64_t)sizeof(T);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
#endif
  }
};

// One sequence, KV heads [h0, h1): out rows (h * g + j) of [kvh * g, d].
template <typename T, int NV>
void attend(const float* qs, const Rows<T>& K, const Rows<T>& V, int64_t kh, int64_t vh,
            int64_t h0, int64_t h1, int64_t g, int64_t d, int64_t first, int64_t len, float sc,
            float* out) {
#ifdef IE_SIMD16
  if constexpr (NV > 0) {
    // One pass over the sequence's cache blocks: a block's keys, then its values (the
    // two lie next to each other in the pool), with an online softmax per query row.
    // The next blocks are prefetched (blocks lie scattered in the pool, a few KB each:
    // too short for the hardware prefetcher).
    const int64_t nrows = (h1 - h0) * g;
    thread_local std::vector<float> acc, probs;
    acc.assign(nrows * d, 0.f);
    probs.resize(nrows * 16);
    float m[256], l[256];
    std::fill(m, m + nrows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + nrows, 0.f);
    const float* qh = qs + h0 * g * d;
    const int64_t bs = K.bs, nblk = (len + bs - 1) / bs;
    for (int64_t a = 1; a <= PREFETCH_AHEAD; ++a) {
      K.prefetch_block(first / bs + a, nblk);
      V.prefetch_block(first / bs + a, nblk);
    }
    const int64_t row_bytes = K.token_stride * (int64_t)sizeof(T);
    for (int64_t b = first / bs; b < nblk; ++b) {
      // Block b + AHEAD + 1 is fetched a token row at a time while this block's keys
      // are scored (a burst of a whole block's prefetches overflows the miss queues).
      const bool ahead_ok = b + PREFETCH_AHEAD + 1 < nblk;
      const char* kp_next = ahead_ok ? reinterpret_cast<const char*>(
          K.base + K.table[b + PREFETCH_AHEAD + 1] * K.block_stride) : nullptr;
      const char* vp_next = ahead_ok ? reinterpret_cast<const char*>(
          V.base + V.table[b + PREFETCH_AHEAD + 1] * V.block_stride) : nullptr;
      const int64_t t0 = std::max(first, b * bs), t1 = std::min(len, (b + 1) * bs);
      const int64_t nt = t1 - t0;
      const T* kblock = K.row(t0);
      const T* vblock = V.row(t0);
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t tt = 0; tt < nt; ++tt) {
          if (h == h0 && ahead_ok) {
            for (int64_t o = 0; o < row_bytes; o += 64) {
              _mm_prefetch(kp_next + tt * row_bytes + o, _MM_HINT_T1);
              _mm_prefetch(vp_next + tt * row_bytes + o, _MM_HINT_T1);
            }
          }
          const T* krow = kblock + tt * K.token_stride + h * kh;
          vf16 kv[NV];
          for (int i = 0; i < NV; ++i) kv[i] = load16(krow + 16 * i);
          for (int64_t j = 0; j < g; ++j) {
            const int64_t r = (h - h0) * g + j;
            const float* qj = qh + r * d;
            vf16 acc_s = vmul(vload(qj), kv[0]);
            for (int i = 1; i < NV; ++i) acc_s = vfmadd(vload(qj + 16 * i), kv[i], acc_s);
            probs[r * 16 + tt] = vreduce_add(acc_s) * sc;
          }
        }
      }
      const mask16 mask = mask_bits((1u << nt) - 1);
      for (int64_t r = 0; r < nrows; ++r)
        online_softmax_step<NV>(vload_masked(mask, probs.data() + r * 16), mask, m[r],
                                l[r], probs.data() + r * 16, acc.data() + r * d);
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t j0 = 0; j0 < g; j0 += 4) {
          const int64_t r0 = (h - h0) * g + j0;
          add_weighted_values<T, NV>(acc.data() + r0 * d, d, probs.data() + r0 * 16,
                                     std::min<int64_t>(4, g - j0), vblock + h * vh,
                                     V.token_stride, nt);
        }
    }
    for (int64_t r = 0; r < nrows; ++r) {
      const vf16 inv = vset1(1.f / l[r]);
      float* o = out + (h0 * g + r) * d;
      const float* ar = acc.data() + r * d;
      for (int i = 0; i < NV; ++i) vstore(o + 16 * i, vmul(vload(ar + 16 * i), inv));
    }
    return;
  }
#endif
  // Any head size: plain loops.
  thread_local std::vector<float> scores;
  const int64_t span = len - first;
  scores.resize(g * span);
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qs + (h * g + j) * d;
      float* sr = scores.data() + j * span;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = first; t < len; ++t) {
        const T* krow = K.row(t) + h * kh;
        float dot = 0.f;
        for (int64_t e = 0; e < d; ++e) dot += qj[e] * to_float(krow[e]);
        sr[t - first] = dot * sc;
        mx = std::max(mx, sr[t - first]);
      }
      float sum = 0.f;
      for (int64_t t = 0; t < span; ++t) {
        sr[t] = std::exp(sr[t] - mx);
        sum += sr[t];
      }
      float* o = out + (h * g + j) * d;
      std::fill(o, o + d, 0.f);
      for (int64_t t = first; t < len; ++t) {
        const T* vrow = V.row(t) + h * vh;
        const float p = sr[t - first] / sum;
        for (int64_t e = 0; e < d; ++e) o[e] += p * to_float(vrow[e]);
      }
    }
  }
}

// Decode attention of n sequences on plain pointers: q rows (n, kvh, g, d) with sequence
// stride qs_stride (heads of a sequence adjacent, d contiguous) -> out [n, kvh, g, d] dense.
template <typename T>
void decode_rows(const float* qp, int64_t qs_stride, int64_t n, int64_t kvh, int64_t g,
                 int64_t d, const T* kp, const int64_t* k_strides, const T* vp,
                 const int64_t* v_strides, int64_t bs, const int64_t* tp, int64_t tstride,
                 const int64_t* lp, float sc, int64_t window, float* op) {
  const int64_t rows = kvh * g;
  // One task per sequence (a token's rows of every head are adjacent); with fewer
  // sequences than threads, each KV head is its own task instead.
  const int64_t split = n < 2 * at::get_num_threads() ? kvh : 1;
  const int64_t heads_per_task = kvh / split;
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) total += lp[s];
  // Waking sleeping OpenMP threads costs more than a short decode takes (batch 1,
  // short contexts): below ~256K multiply-adds stay on the calling thread, below
  // ~16K where the spinning pool (inference_engine.cpu_thread_pool) runs.
  const int64_t serial_below = ie_runner != nullptr ? (int64_t{1} << 14) : (int64_t{1} << 18);
  auto body = [&](int64_t task) {
    const int64_t s = task / split;
    const int64_t h0 = (task % split) * heads_per_task, h1 = h0 + heads_per_task;
    const int64_t len = lp[s];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t* table = tp + s * tstride;
    const Rows<T> K{kp, table, k_strides[0], k_strides[1], bs};
    const Rows<T> V{vp, table, v_strides[0], v_strides[1], bs};
    const float* qs = qp + s * qs_stride;
    float* os = op + s * rows * d;
    const int64_t kh = k_strides[2], vh = v_strides[2];
    switch (d) {
      case 64: attend<T, 4>(qs, K, V, kh, vh, h0, h1, g, d, first, len, sc, os); break;
      case 128: attend<T, 8>(qs, K, V, kh, vh, h0, h1, g, d, first, len, sc, os); break;
      case 32: attend<T, 2>(qs, K, V, kh, vh, h0, h1, g, d, first, len, sc, os); break;
      case 256: attend<T, 16>(qs, K, V, kh, vh, h0, h1, g, d, first, len, sc, os); break;
      default: attend<T, 0>(qs, K, V, kh, vh, h0, h1, g, d, first, len, sc, os); break;
    }
  };
  if (total * rows * d * 2 < serial_below) {
    for (int64_t task = 0; task < n * split; ++task) body(task);
  } else {
    parallel_tasks(n * split, body);
  }
}

inline void store_row(float* dst, const float* src, int64_t d) {
  std::memcpy(dst, src, d * sizeof(float));
}

// float -> bfloat16 rounded to nearest even (NaN -> 0x7FC0), c10::BFloat16's rule,
// written on the bits so the compiler vectorises it.
inline void store_row(at::BFloat16* dst, const float* src, int64_t d) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  int64_t e = 0;
#ifdef __AVX512F__
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i qnan = _mm512_set1_epi32(0x7fc0);
  for (; e + 16 <= d; e += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + e));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    r = _mm512_mask_mov_epi32(r, nan, qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; e < d; ++e) {
    uint32_t u;
    std::memcpy(&u, src + e, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    out[e] = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : (uint16_t)rounded;
  }
}

// Rows i of src (element (i, h, e) at src + i * st + h * sh + e) stored at (blocks[i],
// offsets[i]) of a cache with strides cs = (block, token, head), rounded to T.
template <typename T>
void write_rows(T* cp, const int64_t* cs, const float* sp, int64_t st, int64_t sh,
                int64_t t_count, int64_t heads, int64_t d, const int64_t* blocks,
                const int64_t* offsets) {
  for (int64_t i = 0; i < t_count; ++i) {
    T* dst = cp + blocks[i] * cs[0] + offsets[i] * cs[1];
    const float* row = sp + i * st;
    for (int64_t h = 0; h < heads; ++h) store_row(dst + h * cs[2], row + h * sh, d);
  }
}

}  // namespace

// The plain-pointer bodies of paged_decode and write_kv, for kernels that chain them
// without Python (csrc/cpu_decode_step.cpp reaches them through entry_points()).
// cache_bf16: the caches hold bfloat16 (else float32); *_strides: (block, token, head)
// element strides of the [num_blocks, bs, kvh, d] caches (d contiguous).
extern "C" void ie_paged_decode_raw(const float* q, int64_t qs_stride, int64_t n, int64_t kvh,
                                    int64_t g, int64_t d, const void* k_cache,
                                    const int64_t* k_strides, const void* v_cache,
                                    const int64_t* v_strides, int64_t bs, int cache_bf16,
                                    const int64_t* tables, int64_t tstride, const int64_t* lens,
                                    float scale, int64_t window, float* out) {
  if (cache_bf16)
    decode_rows<at::BFloat16>(q, qs_stride, n, kvh, g, d,
                              static_cast<const at::BFloat16*>(k_cache), k_strides,
                              static_cast<const at::BFloat16*>(v_cache), v_strides, bs, tables,
                              tstride, lens, scale, window, out);
  else
    decode_rows<float>(q, qs_stride, n, kvh, g, d, static_cast<const float*>(k_cache), k_strides,
                       static_cast<const float*>(v_cache), v_strides, bs, tables, tstride, lens,
                       scale, window, out);
}

// key/value rows (strides (token, head), d contiguous) of T tokens stored at their slots.
extern "C" void ie_write_kv_raw(void* k_cache, const int64_t* k_strides, void* v_cache,
                                const int64_t* v_strides, int cache_bf16, const float* key,
                                int64_t kt, int64_t kh, const float* value, int64_t vt,
                                int64_t vh, int64_t t_count, int64_t heads, int64_t d,
                                const int64_t* blocks, const int64_t* offsets) {
  if (cache_bf16) {
    write_rows(static_cast<at::BFloat16*>(k_cache), k_strides, key, kt, kh, t_count, heads, d,
               blocks, offsets);
    write_rows(static_cast<at::BFloat16*>(v_cache), v_strides, value, vt, vh, t_count, heads, d,
               blocks, offsets);
  } else {
    write_rows(static_cast<float*>(k_cache), k_strides, key, kt, kh, t_count, heads, d, blocks,
               offsets);
    write_rows(static_cast<float*>(v_cache), v_strides, value, vt, vh, t_count, heads, d, blocks,
               offsets);
  }
}

namespace {
std::vector<int64_t> strides3(const torch::Tensor& cache) {
  return {cache.stride(0), cache.stride(1), cache.stride(2)};
}
}  // namespace

// q [n, kvh, g, d] float32 contiguous; caches [num_blocks, bs, kvh, d] float32 or
// bfloat16 with contiguous rows (any block stride); tables [n, max_blocks] int64;
// lens [n] int64. Returns [n, kvh, g, d] float32. window <= 0: no sliding window.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale,
                           int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 4);
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(ct == v_cache.scalar_type() && (ct == torch::kFloat32 || ct == torch::kBFloat16),
              "caches must both be float32 or bfloat16");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1);
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64);
  TORCH_CHECK(tables.stride(1) == 1 && lens.is_contiguous());
  TORCH_CHECK(k_cache.size(2) == q.size(1) && k_cache.size(3) == q.size(3));
  TORCH_CHECK(q.size(1) * q.size(2) <= 256, "at most 256 query heads");
  TORCH_CHECK(k_cache.size(1) <= 16, "block size at most 16");
  auto out = torch::empty_like(q);
  const auto ks = strides3(k_cache), vs = strides3(v_cache);
  ie_paged_decode_raw(q.data_ptr<float>(), q.size(1) * q.size(2) * q.size(3), q.size(0),
                      q.size(1), q.size(2), q.size(3), k_cache.data_ptr(), ks.data(),
                      v_cache.data_ptr(), vs.data(), k_cache.size(1), ct == torch::kBFloat16,
                      tables.data_ptr<int64_t>(), tables.stride(0), lens.data_ptr<int64_t>(),
                      static_cast<float>(scale), window, out.data_ptr<float>());
  return out;
}

// Store key/value [T, kvh, d] float32 (last dim dense) at (blocks[i], offsets[i]) of
// the caches, rounding to the cache dtype (bfloat16: to nearest even, as torch does).
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor key,
              torch::Tensor value, torch::Tensor blocks, torch::Tensor offsets) {
  TORCH_CHECK(key.scalar_type() == torch::kFloat32 && value.scalar_type() == torch::kFloat32);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1);
  TORCH_CHECK(blocks.scalar_type() == torch::kInt64 && offsets.scalar_type() == torch::kInt64);
  TORCH_CHECK(blocks.is_contiguous() && offsets.is_contiguous());
  TORCH_CHECK(blocks.size(0) == key.size(0) && offsets.size(0) == key.size(0));
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3));
  TORCH_CHECK(value.size(1) == v_cache.size(2) && value.size(2) == v_cache.size(3));
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1);
  for (int64_t i = 0; i < blocks.size(0); ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < nb && op[i] >= 0 && op[i] < bs, "slot out of range");
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(ct == v_cache.scalar_type() && (ct == torch::kFloat32 || ct == torch::kBFloat16));
  const auto ks = strides3(k_cache), vs = strides3(v_cache);
  ie_write_kv_raw(k_cache.data_ptr(), ks.data(), v_cache.data_ptr(), vs.data(),
                  ct == torch::kBFloat16, key.data_ptr<float>(), key.stride(0), key.stride(1),
                  value.data_ptr<float>(), value.stride(0), value.stride(1), key.size(0),
                  key.size(1), key.size(2), bp, op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("write_kv", torch::wrap_pybind_function(write_kv), "write_kv");
  m.def("entry_points", []() {
    return std::map<std::string, int64_t>{
        {"paged_decode", reinterpret_cast<int64_t>(&ie_paged_decode_raw)},
        {"write_kv", reinterpret_cast<int64_t>(&ie_write_kv_raw)}};
  }, "addresses of the plain-pointer kernels");
  m.def("set_parallel_runner", torch::wrap_pybind_function(set_parallel_runner),
        "set_parallel_runner");
}
