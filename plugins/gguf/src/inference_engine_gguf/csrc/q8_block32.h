// 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL, and IQ4_XS's 32-value
// sub-blocks) times 8-bit activations in llama.cpp's CPU arithmetic, from raw GGML rows
// (no packing). Included once, by
// q8k_matmul.cpp (it uses that file's parallel_tasks from ie_parallel_tasks.h).
//
// llama.cpp rounds the activations of these types to Q8_0 (Q4_0, Q5_0, Q8_0, MXFP4, IQ4_NL)
// or Q8_1 (Q4_1, Q5_1): per 32 values d = max|x| / 127 (stored fp16), quants
// round_half_even(x * 127 / max|x|), and for Q8_1 also s = fp16(d * sum of the quants).
// A block's dot product is then d_w * d_a * (integer sum of quant products), plus
// m_w * s_a for the types with a min (Q4_1, Q5_1); the blocks' terms are summed in float.
#ifndef IE_Q8_BLOCK32_H
#define IE_Q8_BLOCK32_H

#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ggml_helpers.h"

namespace ie_block32 {

using ie_ggml::f16;

// GGML type ids (gguf.constants.GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kIQ4_NL = 20,
                  kIQ4_XS = 23, kMXFP4 = 39;

// The activation rounding llama.cpp pairs with a weight type.
enum class Acts { None, Q8_0, Q8_1 };

inline Acts acts_for(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kQ5_0: case kQ8_0: case kIQ4_NL: case kMXFP4: return Acts::Q8_0;
    case kQ4_1: case kQ5_1: return Acts::Q8_1;
    default: return Acts::None;
  }
}

inline int64_t type_size(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kIQ4_NL: return 18;
    case kMXFP4: return 17;
    default: TORCH_CHECK(false, "GGML type ", qtype, " has no 32-value block dot product");
  }
  return 0;
}

// Quant values of the table types (MXFP4: e2m1 doubled, the scale halved to match).
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// llama.cpp's x86 quantize_row_q8_1 for one row (k % 32 == 0): as quantize_row_q8_0, plus
// s = fp16(d * sum of the block's quants) with d the float max / 127 (before fp16).
// d and s are written as floats (their fp16 values).
inline void quantize_row_q8_1(const float* x, int64_t k, int8_t* qs, float* d, float* s) {
  for (int64_t b = 0; b < k / 32; ++b, x += 32, qs += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float dd = amax / 127.f;
    d[b] = static_cast<float>(c10::Half(dd));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(x[j] * id));
      qs[j] = static_cast<int8_t>(std::max(-128, std::min(127, q)));
      sum += qs[j];
    }
    s[b] = static_cast<float>(c10::Half(dd * static_cast<float>(sum)));
  }
}

// One raw block -> its 32 quants in activation order (signed: the stored offset removed),
// its scale d and its min m (0 for the types without one).
inline void unpack_block(int64_t qtype, const uint8_t* b, int8_t* q, float* d, float* m) {
  *m = 0.f;
  switch (qtype) {
    case kQ4_0:
      *d = f16(b);
      for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t)((b[2 + j] & 0xF) - 8);
        q[j + 16] = (int8_t)((b[2 + j] >> 4) - 8);
      }
      break;
    case kQ4_1:
      *d = f16(b);
      *m = f16(b + 2);
      for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t)(b[4 + j] & 0xF);
        q[j + 16] = (int8_t)(b[4 + j] >> 4);
      }
      break;
    case kQ5_0:
    case kQ5_1: {
      const bool min = qtype == kQ5_1;
      *d = f16(b);
      if (min) *m = f16(b + 2);
      const uint8_t* hb = b + (min ? 4 : 2);
      const uint8_t* ql = hb + 4;
      uint32_t qh;
      std::memcpy(&qh, hb, 4);
      const int offset = min ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t)(((ql[j] & 0xF) | (((qh >> j) & 1) << 4)) - offset);
        q[j + 16] = (int8_t)(((ql[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - offset);
      }
      break;
    }
    case kQ8_0:
      *d = f16(b);
      std::memcpy(q, b + 2, 32);
      break;
    case kIQ4_NL:
      *d = f16(b);
      for (int j = 0; j < 16; ++j) {
        q[j] = kIQ4NLValues[b[2 + j] & 0xF];
        q[j + 16] = kIQ4NLValues[b[2 + j] >> 4];
      }
      break;
    case kMXFP4:
      *d = std::ldexp(1.f, (int)b[0] - 128);  // ggml's E8M0_TO_FP32_HALF
      for (int j = 0; j < 16; ++j) {
        q[j] = kMXFP4Values[b[1 + j] & 0xF];
        q[j + 16] = kMXFP4Values[b[1 + j] >> 4];
      }
      break;
    default: TORCH_CHECK(false, "GGML type ", qtype, " has no 32-value block dot product");
  }
}

// The integer dot product of 32 weight quants (|w| <= 128) and 32 activation quants
// (|a| <= 127): exact in int16 pairs (2 * 128 * 127 < 2^15), then in int32.
#if defined(__AVX2__)
inline __m256i dot32(const int8_t* w, const int8_t* a) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i aw = _mm256_sign_epi8(wv, wv), sa = _mm256_sign_epi8(av, wv);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sa);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), _mm256_set1_epi16(1));
#endif
}

inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

// Unpacked weight rows of one task: quants [rows][k], scales and mins [rows][nb].
struct Unpacked {
  std::vector<int8_t> q;
  std::vector<float> d, m;
};

// One activation row (quants qs [k], scales da [nb], Q8_1 sums sa [nb] or null) . one
// unpacked weight row.
inline float dot_row(const int8_t* wq, const float* wd, const float* wm, const int8_t* qs,
                     const float* da, const float* sa, int64_t nb) {
  float summs = 0.f;
  if (sa != nullptr)
    for (int64_t b = 0; b < nb; ++b) summs += wm[b] * sa[b];
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b)
    acc = _mm256_fmadd_ps(_mm256_set1_ps(wd[b] * da[b]),
                          _mm256_cvtepi32_ps(dot32(wq + 32 * b, qs + 32 * b)), acc);
  return hsum8(acc) + summs;
#else
  float sum = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t isum = 0;
    for (int j = 0; j < 32; ++j) isum += (int32_t)wq[32 * b + j] * qs[32 * b + j];
    sum += (float)isum * (wd[b] * da[b]);
  }
  return sum + summs;
#endif
}

constexpr int64_t kRowsPerTask = 8;

// out [M, N] (row stride ldy) = activations (qs [M, k], da [M, nb], sa [M, nb] for Q8_1
// else null) . raw rows [N, row_bytes] of type qtype.
inline void matmul_into(const int8_t* qs, const float* da, const float* sa, int64_t m,
                        int64_t k, const uint8_t* raw, int64_t n, int64_t qtype, float* out,
                        int64_t ldy) {
  const int64_t nb = k / 32, ts = type_size(qtype), row_bytes = nb * ts;
  const bool with_min = acts_for(qtype) == Acts::Q8_1;
  TORCH_CHECK(with_min == (sa != nullptr), "activation rounding does not match the type");
  parallel_tasks((n + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    thread_local Unpacked u;
    if ((int64_t)u.q.size() < kRowsPerTask * k) u.q.resize(kRowsPerTask * k);
    if ((int64_t)u.d.size() < kRowsPerTask * nb) {
      u.d.resize(kRowsPerTask * nb);
      u.m.resize(kRowsPerTask * nb);
    }
    const int64_t n0 = task * kRowsPerTask, rows = std::min(kRowsPerTask, n - n0);
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t b = 0; b < nb; ++b)
        unpack_block(qtype, raw + (n0 + j) * row_bytes + b * ts, u.q.data() + j * k + 32 * b,
                     &u.d[j * nb + b], &u.m[j * nb + b]);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < rows; ++j)
        out[r * ldy + n0 + j] = dot_row(u.q.data() + j * k, u.d.data() + j * nb,
                                        u.m.data() + j * nb, qs + r * k, da + r * nb,
                                        sa != nullptr ? sa + r * nb : nullptr, nb);
  });
}

// ---- IQ4_XS x Q8_K (llama.cpp's ggml_vec_dot_iq4_xs_q8_K) ----
// A 136-byte block holds 256 values: fp16 d, 16 bits of high scale bits, 4 bytes of low
// scale nibbles, then 8 sub-blocks of 32 IQ4_NL-table quants (16 bytes each: low nibbles
// are values 0..15, high nibbles 16..31). Sub-block s has the integer scale
// ls = (4 low bits | 2 high bits << 4) - 32. A block's dot product with Q8_K activations
// is d_w * d_a * sum_s ls[s] * (integer sum of its 32 quant products).
constexpr int64_t kIQ4XSBytes = 136;

inline void unpack_iq4_xs(const uint8_t* b, int8_t* q, int32_t* ls, float* d) {
  *d = f16(b);
  uint16_t sh;
  std::memcpy(&sh, b + 2, 2);
  for (int s = 0; s < 8; ++s) {
    ls[s] = (((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4)) - 32;
    const uint8_t* qs = b + 8 + 16 * s;
    for (int j = 0; j < 16; ++j) {
      q[32 * s + j] = kIQ4NLValues[qs[j] & 0xF];
      q[32 * s + j + 16] = kIQ4NLValues[qs[j] >> 4];
    }
  }
}

// One Q8_K activation row (qs [k], da [k/256]) . one unpacked IQ4_XS row.
inline float dot_row_iq4_xs(const int8_t* wq, const int32_t* ls, const float* wd,
                            const int8_t* qs, const float* da, int64_t nb) {
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      const int64_t off = 256 * b + 32 * s;
      isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(dot32(wq + off, qs + off),
                                                       _mm256_set1_epi32(ls[8 * b + s])));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(wd[b] * da[b]), _mm256_cvtepi32_ps(isum), acc);
  }
  return hsum8(acc);
#else
  float sum = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t isum = 0;
    for (int s = 0; s < 8; ++s) {
      int32_t dot = 0;
      for (int j = 0; j < 32; ++j) dot += (int32_t)wq[256 * b + 32 * s + j] * qs[256 * b + 32 * s + j];
      isum += ls[8 * b + s] * dot;
    }
    sum += (float)isum * (wd[b] * da[b]);
  }
  return sum;
#endif
}

// out [M, N] (row stride ldy) = Q8_K activations (qs [M, k], da [M, k/256]) . IQ4_XS rows.
inline void iq4_xs_matmul_into(const int8_t* qs, const float* da, int64_t m, int64_t k,
                               const uint8_t* raw, int64_t n, float* out, int64_t ldy) {
  const int64_t nb = k / 256, row_bytes = nb * kIQ4XSBytes;
  parallel_tasks((n + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    thread_local std::vector<int8_t> q;
    thread_local std::vector<int32_t> ls;
    thread_local std::vector<float> d;
    if ((int64_t)q.size() < kRowsPerTask * k) q.resize(kRowsPerTask * k);
    if ((int64_t)d.size() < kRowsPerTask * nb) {
      d.resize(kRowsPerTask * nb);
      ls.resize(kRowsPerTask * nb * 8);
    }
    const int64_t n0 = task * kRowsPerTask, rows = std::min(kRowsPerTask, n - n0);
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t b = 0; b < nb; ++b)
        unpack_iq4_xs(raw + (n0 + j) * row_bytes + b * kIQ4XSBytes, q.data() + j * k + 256 * b,
                      ls.data() + (j * nb + b) * 8, &d[j * nb + b]);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < rows; ++j)
        out[r * ldy + n0 + j] = dot_row_iq4_xs(q.data() + j * k, ls.data() + j * nb * 8,
                                               d.data() + j * nb, qs + r * k, da + r * nb, nb);
  });
}

}  // namespace ie_block32

#endif  // IE_Q8_BLOCK32_H
