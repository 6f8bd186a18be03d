// GGML blocks x float32 activations, dequantized tile by tile and multiplied, fused
// (inference_engine_gguf.cpu_kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "ggml_helpers.h"
#include "ie_parallel_tasks.h"

namespace {

using ie_ggml::f16;
using ie_ggml::q3k_scales;
using ie_ggml::scale_min_k4;

// Block dequantizers, ggml-quants.c's dequantize_row_* for one block.
// Each writes block_size floats to y.

void dq_q4_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = (float)((int)(qs[j] & 0x0F) - 8) * d;
    y[j + 16] = (float)((int)(qs[j] >> 4) - 8) * d;
  }
}

void dq_q4_1(const uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = (float)(qs[j] & 0x0F) * d + m;
    y[j + 16] = (float)(qs[j] >> 4) * d + m;
  }
}

void dq_q5_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
    y[j] = (float)(((qs[j] & 0x0F) | h0) - 16) * d;
    y[j + 16] = (float)(((qs[j] >> 4) | h1) - 16) * d;
  }
}

void dq_q5_1(const uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
    y[j] = (float)((qs[j] & 0x0F) | h0) * d + m;
    y[j + 16] = (float)((qs[j] >> 4) | h1) * d + m;
  }
}

void dq_q8_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = (float)qs[j] * d;
}

void dq_q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = scales[is++];
        const float dl = d * (float)(sc & 0x0F), ml = dmin * (float)(sc >> 4);
        const uint8_t* qq = q + 16 * half;
        #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
        for (int l = 0; l < 16; ++l) y[l] = (float)((qq[l] >> shift) & 3) * dl - ml;
        y += 16;
      }
      shift += 2;
    }
    q += 32;
  }
}

void dq_q3_k(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d_all = f16(b + 108);
  int8_t scales[16];
  q3k_scales(b, scales);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d_all * (float)(scales[is++] - 32);
        const uint8_t* qq = q + 16 * half;
        const uint8_t* hh = hm + 16 * half;
        #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
        for (int l = 0; l < 16; ++l) {
          const int v = (int)((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4);
          y[l] = (float)v * dl;
        }
        y += 16;
      }
      shift += 2;
      m <<= 1;
    }
    q += 32;
  }
}

// The scales and mins of sub-blocks is and is + 1 (one 64-value group of Q4_K / Q5_K).
inline void k4_scale_pair(int is, const uint8_t* scales, float d, float dmin, float* d1,
                          float* m1, float* d2, float* m2) {
  uint8_t sc, m;
  scale_min_k4(is, scales, &sc, &m);
  *d1 = d * (float)sc;
  *m1 = dmin * (float)m;
  scale_min_k4(is + 1, scales, &sc, &m);
  *d2 = d * (float)sc;
  *m2 = dmin * (float)m;
}

void dq_q4_k(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
    float d1, m1, d2, m2;
    k4_scale_pair(is, scales, d, dmin, &d1, &m1, &d2, &m2);
    for (int l = 0; l < 32; ++l) y[l] = (float)(q[l] & 0xF) * d1 - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = (float)(q[l] >> 4) * d2 - m2;
    q += 32;
    y += 64;
  }
}

void dq_q5_k(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
    float d1, m1, d2, m2;
    k4_scale_pair(is, scales, d, dmin, &d1, &m1, &d2, &m2);
    for (int l = 0; l < 32; ++l)
      y[l] = (float)((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) * d1 - m1;
    for (int l = 0; l < 32; ++l)
      y[l + 32] = (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) * d2 - m2;
    ql += 32;
    y += 64;
    u1 <<= 2;
    u2 <<= 2;
  }
}

void dq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  // Loops of 16 values sharing one scale, so that they vectorise.
  for (int n = 0; n < 256; n += 128) {
    for (int g = 0; g < 2; ++g) {
      const uint8_t* l0 = ql + 16 * g;
      const uint8_t* l1 = ql + 32 + 16 * g;
      const uint8_t* h = qh + 16 * g;
      const float d1 = d * (float)sc[g], d2 = d * (float)sc[g + 2];
      const float d3 = d * (float)sc[g + 4], d4 = d * (float)sc[g + 6];
      float* o = y + 16 * g;
      #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
      for (int l = 0; l < 16; ++l)
        o[l] = (float)((int)((l0[l] & 0xF) | (((h[l] >> 0) & 3) << 4)) - 32) * d1;
      #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
      for (int l = 0; l < 16; ++l)
        o[l + 32] = (float)((int)((l1[l] & 0xF) | (((h[l] >> 2) & 3) << 4)) - 32) * d2;
      #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
      for (int l = 0; l < 16; ++l)
        o[l + 64] = (float)((int)((l0[l] >> 4) | (((h[l] >> 4) & 3) << 4)) - 32) * d3;
      #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
      for (int l = 0; l < 16; ++l)
        o[l + 96] = (float)((int)((l1[l] >> 4) | (((h[l] >> 6) & 3) << 4)) - 32) * d4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

#if defined(__AVX512F__) && defined(__AVX2__)
// AVX-512 versions of the hot types (what a Q4_K_M file holds, and Q8_0/Q4_0).
// Same operations as the scalar loops above (int -> float, one multiply, one
// subtract, no FMA), so the values are bit-identical; gcc does not vectorise
// those loops well (bytes widened to floats, short trip counts).
#define GGML_SIMD_DEQUANT 1

// 16 bytes (unsigned or signed) -> 16 floats: q * scale [- offset].
inline void put_u8(float* y, __m128i q, __m512 scale) {
  _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), scale));
}
inline void put_u8(float* y, __m128i q, __m512 scale, __m512 offset) {
  const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), scale);
  _mm512_storeu_ps(y, _mm512_sub_ps(v, offset));
}
inline void put_i8(float* y, __m128i q, __m512 scale) {
  _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale));
}

void dq_q4_k_simd(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
    float sd1, sm1, sd2, sm2;
    k4_scale_pair(is, scales, d, dmin, &sd1, &sm1, &sd2, &sm2);
    const __m512 d1 = _mm512_set1_ps(sd1), m1 = _mm512_set1_ps(sm1);
    const __m512 d2 = _mm512_set1_ps(sd2), m2 = _mm512_set1_ps(sm2);
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i lo = _mm256_and_si256(qb, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), low);
    put_u8(y, _mm256_castsi256_si128(lo), d1, m1);
    put_u8(y + 16, _mm256_extracti128_si256(lo, 1), d1, m1);
    put_u8(y + 32, _mm256_castsi256_si128(hi), d2, m2);
    put_u8(y + 48, _mm256_extracti128_si256(hi, 1), d2, m2);
    q += 32;
    y += 64;
  }
}

void dq_q6_k_simd(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  const __m128i low = _mm_set1_epi8(0x0F), two = _mm_set1_epi8(0x03), off = _mm_set1_epi8(32);
  for (int n = 0; n < 256; n += 128) {
    for (int g = 0; g < 2; ++g) {
      const __m128i l0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 16 * g));
      const __m128i l1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 32 + 16 * g));
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * g));
      // (high two bits << 4) for each of the four groups, bytewise.
      const __m128i h1 = _mm_slli_epi16(_mm_and_si128(h, two), 4);
      const __m128i h2 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2), two), 4);
      const __m128i h3 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 4), two), 4);
      const __m128i h4 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 6), two), 4);
      const __m128i q1 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(l0, low), h1), off);
      const __m128i q2 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(l1, low), h2), off);
      const __m128i q3 = _mm_sub_epi8(
          _mm_or_si128(_mm_and_si128(_mm_srli_epi16(l0, 4), low), h3), off);
      const __m128i q4 = _mm_sub_epi8(
          _mm_or_si128(_mm_and_si128(_mm_srli_epi16(l1, 4), low), h4), off);
      float* o = y + 16 * g;
      put_i8(o, q1, _mm512_set1_ps(d * (float)sc[g]));
      put_i8(o + 32, q2, _mm512_set1_ps(d * (float)sc[g + 2]));
      put_i8(o + 64, q3, _mm512_set1_ps(d * (float)sc[g + 4]));
      put_i8(o + 96, q4, _mm512_set1_ps(d * (float)sc[g + 6]));
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

void dq_q8_0_simd(const uint8_t* b, float* y) {
  const __m512 d = _mm512_set1_ps(f16(b));
  put_i8(y, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), d);
  put_i8(y + 16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)), d);
}

void dq_q4_0_simd(const uint8_t* b, float* y) {
  const __m512 d = _mm512_set1_ps(f16(b));
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
  const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  put_i8(y, _mm_sub_epi8(_mm_and_si128(qs, low), eight), d);
  put_i8(y + 16, _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), low), eight), d);
}
#endif

using BlockFn = void (*)(const uint8_t*, float*);

struct TypeInfo {
  BlockFn fn;
  int64_t block_size;
  int64_t type_size;
};

// Keyed by GGML type id (gguf.constants.GGMLQuantizationType).
TypeInfo type_info(int64_t qtype) {
#if defined(GGML_SIMD_DEQUANT)
  switch (qtype) {
    case 2: return {dq_q4_0_simd, 32, 18};
    case 8: return {dq_q8_0_simd, 32, 34};
    case 12: return {dq_q4_k_simd, 256, 144};
    case 14: return {dq_q6_k_simd, 256, 210};
    default: break;
  }
#endif
  switch (qtype) {
    case 2: return {dq_q4_0, 32, 18};
    case 3: return {dq_q4_1, 32, 20};
    case 6: return {dq_q5_0, 32, 22};
    case 7: return {dq_q5_1, 32, 24};
    case 8: return {dq_q8_0, 32, 34};
    case 10: return {dq_q2_k, 256, 84};
    case 11: return {dq_q3_k, 256, 110};
    case 12: return {dq_q4_k, 256, 144};
    case 13: return {dq_q5_k, 256, 176};
    case 14: return {dq_q6_k, 256, 210};
    default: TORCH_CHECK(false, "GGML type ", qtype, " has no CPU kernel");
  }
}

inline void dequant_row(const TypeInfo& t, const uint8_t* row, int64_t num_blocks, float* y) {
  for (int64_t i = 0; i < num_blocks; ++i) t.fn(row + i * t.type_size, y + i * t.block_size);
}

// y[m, n] for MB activation rows and NB weight rows; K is a multiple of 32.
template <int MB, int NB>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k,
                  float* y, int64_t ldy) {
#if defined(__AVX512F__)
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
#else
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      const float* xr = x + i * ldx;
      const float* wr = w + j * ldw;
      float lanes[16] = {0};
      for (int64_t p = 0; p < k; p += 16)
        #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
        for (int l = 0; l < 16; ++l) lanes[l] += xr[p + l] * wr[p + l];
      float s = 0.f;
      #pragma GCC unroll 1  // fully unrolled, gcc no longer vectorises it
      for (int l = 0; l < 16; ++l) s += lanes[l];
      y[i * ldy + j] = s;
    }
  }
#endif
}

template <int MB>
inline void micro_rows(int nb, const float* x, int64_t ldx, const float* w, int64_t ldw,
                       int64_t k, float* y, int64_t ldy) {
  switch (nb) {
    case 4: micro<MB, 4>(x, ldx, w, ldw, k, y, ldy); break;
    case 3: micro<MB, 3>(x, ldx, w, ldw, k, y, ldy); break;
    case 2: micro<MB, 2>(x, ldx, w, ldw, k, y, ldy); break;
    default: micro<MB, 1>(x, ldx, w, ldw, k, y, ldy); break;
  }
}

}  // namespace

// x [M, K] float32 (rows contiguous), raw [N, row_bytes] uint8 contiguous.
// Returns y [M, N] float32 = x @ dequantize(raw).T.
torch::Tensor ggml_linear(torch::Tensor x, torch::Tensor raw, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous());
  const TypeInfo t = type_info(qtype);
  const int64_t m = x.size(0), k = x.size(1), n = raw.size(0);
  TORCH_CHECK(k % t.block_size == 0, "K=", k, " is not a multiple of the block size");
  const int64_t num_blocks = k / t.block_size;
  TORCH_CHECK(raw.size(1) == num_blocks * t.type_size, "row bytes do not match K");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  const int64_t rb = raw.size(1);
  float* yp = y.data_ptr<float>();
  // Weight rows per tile: a multiple of 4 whose float32 buffer stays within ~64 KiB.
  const int64_t tile = std::max<int64_t>(4, std::min<int64_t>(32, (16384 / k) / 4 * 4));
  const int64_t num_tiles = (n + tile - 1) / tile;
  // One task per tile, claimed one by one: on a busy machine a thread that
  // starts late (or is descheduled) takes fewer tiles instead of holding up the
  // others. Decode calls these back to back, so they run on the core's spinning
  // pool where it is on (inference_engine.cpu_thread_pool).
  parallel_tasks(num_tiles, [&](int64_t ti) {
    thread_local std::vector<float> buf;
    if ((int64_t)buf.size() < tile * k) buf.resize(tile * k);
    {
      const int64_t n0 = ti * tile, rows = std::min(tile, n - n0);
      for (int64_t r = 0; r < rows; ++r)
        dequant_row(t, rp + (n0 + r) * rb, num_blocks, buf.data() + r * k);
      for (int64_t i0 = 0; i0 < m; i0 += 4) {
        const int64_t mb = std::min<int64_t>(4, m - i0);
        const float* xi = xp + i0 * ldx;
        for (int64_t j0 = 0; j0 < rows; j0 += 4) {
          const int nb = (int)std::min<int64_t>(4, rows - j0);
          const float* wj = buf.data() + j0 * k;
          float* yo = yp + i0 * n + n0 + j0;
          switch (mb) {
            case 4: micro_rows<4>(nb, xi, ldx, wj, k, k, yo, n); break;
            case 3: micro_rows<3>(nb, xi, ldx, wj, k, k, yo, n); break;
            case 2: micro_rows<2>(nb, xi, ldx, wj, k, k, yo, n); break;
            default: micro_rows<1>(nb, xi, ldx, wj, k, k, yo, n); break;
          }
        }
      }
    }
  });
  return y;
}

// raw [V, row_bytes] uint8 contiguous, ids [T] int64 -> [T, K] float32 (those rows only).
torch::Tensor ggml_dequantize_rows(torch::Tensor raw, torch::Tensor ids, int64_t qtype) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64);
  const TypeInfo t = type_info(qtype);
  const int64_t rb = raw.size(1), v = raw.size(0);
  TORCH_CHECK(rb % t.type_size == 0, "rows are not whole blocks");
  const int64_t num_blocks = rb / t.type_size, k = num_blocks * t.block_size;
  auto idc = ids.contiguous();
  const int64_t num = idc.size(0);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < num; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < v, "row id ", ip[i], " out of range [0, ", v, ")");
  auto y = torch::empty({num, k}, torch::dtype(torch::kFloat32));
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, num, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row(t, rp + ip[i] * rb, num_blocks, yp + i * k);
  });
  return y;
}

// raw [N, row_bytes] uint8 contiguous -> every row dequantized, [N, K] float32.
torch::Tensor ggml_dequantize(torch::Tensor raw, int64_t qtype) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous());
  const TypeInfo t = type_info(qtype);
  const int64_t rb = raw.size(1), n = raw.size(0);
  TORCH_CHECK(rb % t.type_size == 0, "rows are not whole blocks");
  const int64_t num_blocks = rb / t.type_size, k = num_blocks * t.block_size;
  auto y = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row(t, rp + i * rb, num_blocks, yp + i * k);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ggml_linear", torch::wrap_pybind_function(ggml_linear), "ggml_linear");
  m.def("ggml_dequantize_rows", torch::wrap_pybind_function(ggml_dequantize_rows),
        "ggml_dequantize_rows");
  m.def("ggml_dequantize", torch::wrap_pybind_function(ggml_dequantize), "ggml_dequantize");
  m.def("set_parallel_runner", torch::wrap_pybind_function(set_parallel_runner),
        "set_parallel_runner");
}
