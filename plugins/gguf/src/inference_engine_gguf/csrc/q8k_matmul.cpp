// Block-type matmuls in llama.cpp's integer arithmetic (inference_engine_gguf.q8k_kernels):
// K-quants x Q8_K, packed Q8_0 / Q4_0 tiles x Q8_0, and the 32-value block types' raw rows x
// Q8_0 / Q8_1 (q8_block32.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "ggml_helpers.h"
#include "ie_parallel_tasks.h"
#include "q8_block32.h"
#include "q8_tile_simd.h"

namespace {

using ie_ggml::f16;
using ie_ggml::q3k_scales;
using ie_ggml::scale_min_k4;

// ggml's nearest_int: round half to even through the float mantissa (|v| < 2^22).
inline int nearest_int(float v) {
  float t = v + 12582912.f;
  int32_t i;
  std::memcpy(&i, &t, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// ggml's quantize_row_q8_K_ref for one row of k values (k % 256 == 0).
void quantize_row_q8k(const float* x, int64_t k, int8_t* qs, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < k / 256; ++b, x += 256, qs += 256, bsums += 16) {
#if defined(__AVX512F__)
    // The same values as the loops below: the largest magnitude, the first value that
    // has it, then one multiply and ggml's mantissa rounding per value.
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 vmax = _mm512_setzero_ps();
    for (int j = 0; j < 256; j += 16)
      vmax = _mm512_max_ps(vmax, _mm512_and_ps(_mm512_loadu_ps(x + j), abs_mask));
    const float amax = _mm512_reduce_max_ps(vmax);
    if (!(amax > 0.f)) {
      d[b] = 0.f;
      std::memset(qs, 0, 256);
      std::memset(bsums, 0, 32);
      continue;
    }
    int first = 0;
    for (int j = 0; j < 256; j += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(
          _mm512_and_ps(_mm512_loadu_ps(x + j), abs_mask), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (hit) {
        first = j + __builtin_ctz(hit);
        break;
      }
    }
    const float iscale = -127.f / x[first];
    const __m512 scale = _mm512_set1_ps(iscale), magic = _mm512_set1_ps(12582912.f);
    const __m512i mantissa = _mm512_set1_epi32(0x007fffff), bias = _mm512_set1_epi32(0x00400000);
    for (int g = 0; g < 16; ++g) {
      const __m512 t = _mm512_add_ps(_mm512_mul_ps(scale, _mm512_loadu_ps(x + 16 * g)), magic);
      __m512i v = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(t), mantissa), bias);
      v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16 * g), _mm512_cvtsepi32_epi8(v));
      bsums[g] = (int16_t)_mm512_reduce_add_epi32(v);
    }
    d[b] = 1.f / iscale;
#else
    float max = 0.f, amax = 0.f;
    for (int j = 0; j < 256; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (amax == 0.f) {
      d[b] = 0.f;
      std::memset(qs, 0, 256);
      std::memset(bsums, 0, 32);
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < 256; ++j) qs[j] = (int8_t)std::min(127, nearest_int(iscale * x[j]));
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += qs[16 * g + l];
      bsums[g] = (int16_t)sum;
    }
    d[b] = 1.f / iscale;
#endif
  }
}

// One weight block rewritten for integer dot products against Q8_K activations:
//   block . a = d * da * sum_g scale[g] * (w[16g..16g+16) . a[16g..])
//             - dm * da * sum_g offset[g] * bsum[g]
// with w unsigned quants in activation order (the weight's own sign offset, or its
// min, moved into the offset term, which the activations' bsums make one product).
// The offset term is summed in float: moff[g] = dm * offset[g] (exact: an fp16 times a
// small integer) against -da * bsum[g], one FMA per block alongside the integer part.
struct alignas(64) Prepared {
  uint8_t w[256];
  int16_t lanes[4][32];  // scale of each int16 pair lane of each 64-value chunk
  alignas(32) int16_t scale[16];
  alignas(32) int16_t offset[16];
  alignas(64) float moff[16];
  float d, dm;
};

inline void expand_lanes(Prepared* p) {
#if defined(__AVX512BW__)
  _mm512_store_ps(p->moff, _mm512_mul_ps(_mm512_set1_ps(p->dm), _mm512_cvtepi32_ps(
      _mm512_cvtepi16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(p->offset))))));
  const __m512i scales = _mm512_castsi256_si512(
      _mm256_load_si256(reinterpret_cast<const __m256i*>(p->scale)));
  const __m512i eighth = _mm512_srli_epi16(
      _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                       15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);  // i / 8
  for (int c = 0; c < 4; ++c) {
    const __m512i idx = _mm512_add_epi16(eighth, _mm512_set1_epi16((short)(4 * c)));
    _mm512_store_si512(reinterpret_cast<void*>(p->lanes[c]),
                       _mm512_permutexvar_epi16(idx, scales));
  }
#else
  for (int g = 0; g < 16; ++g) p->moff[g] = p->dm * (float)p->offset[g];
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 32; ++i) p->lanes[c][i] = p->scale[4 * c + i / 8];
#endif
}

// Q4_K / Q5_K: fp16 d and dmin, then 8 six-bit scales and mins, each for 32 values.
void k4_scales(const uint8_t* b, Prepared* p) {
  p->d = f16(b);
  p->dm = f16(b + 2);
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    p->scale[2 * s] = p->scale[2 * s + 1] = sc;
    p->offset[2 * s] = p->offset[2 * s + 1] = m;
  }
}

void prep_q4_k(const uint8_t* b, Prepared* p) {
  k4_scales(b, p);
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j, q += 32) {
    for (int l = 0; l < 32; ++l) {
      p->w[64 * j + l] = q[l] & 0xF;
      p->w[64 * j + 32 + l] = q[l] >> 4;
    }
  }
  expand_lanes(p);
}

void prep_q5_k(const uint8_t* b, Prepared* p) {
  k4_scales(b, p);
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int j = 0; j < 4; ++j, ql += 32) {
    const uint8_t u1 = (uint8_t)(1 << (2 * j)), u2 = (uint8_t)(2 << (2 * j));
    for (int l = 0; l < 32; ++l) {
      p->w[64 * j + l] = (ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0);
      p->w[64 * j + 32 + l] = (ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0);
    }
  }
  expand_lanes(p);
}

void prep_q6_k(const uint8_t* b, Prepared* p) {
  p->d = p->dm = f16(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int g = 0; g < 16; ++g) {
    p->scale[g] = sc[g];
    p->offset[g] = (int16_t)(32 * sc[g]);  // quants are stored + 32
  }
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    uint8_t* w = p->w + 128 * h;
    for (int l = 0; l < 32; ++l) {
      w[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
      w[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
      w[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      w[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
  }
  expand_lanes(p);
}

void prep_q2_k(const uint8_t* b, Prepared* p) {
  p->d = f16(b + 80);
  p->dm = f16(b + 82);
  for (int g = 0; g < 16; ++g) {
    p->scale[g] = b[g] & 0xF;
    p->offset[g] = b[g] >> 4;
  }
  // Group g = 8n + 2j + half holds bits 2j.. of q[32n + 16 half + l].
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        const uint8_t* q = b + 16 + 32 * n + 16 * half;
        uint8_t* w = p->w + 16 * (8 * n + 2 * j + half);
        for (int l = 0; l < 16; ++l) w[l] = (q[l] >> (2 * j)) & 3;
      }
  expand_lanes(p);
}

void prep_q3_k(const uint8_t* b, Prepared* p) {
  p->d = p->dm = f16(b + 108);
  int8_t scales[16];
  q3k_scales(b, scales);
  for (int g = 0; g < 16; ++g) {
    p->scale[g] = scales[g] - 32;
    p->offset[g] = (int16_t)(4 * (scales[g] - 32));  // quant = w - 4
  }
  // Like Q2_K, plus the high bit from hmask: set means +0, clear means -4.
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        const uint8_t* q = b + 32 + 32 * n + 16 * half;
        const uint8_t* hm = b + 16 * half;
        const uint8_t bit = (uint8_t)(1 << (4 * n + j));
        uint8_t* w = p->w + 16 * (8 * n + 2 * j + half);
        for (int l = 0; l < 16; ++l) w[l] = ((q[l] >> (2 * j)) & 3) + ((hm[l] & bit) ? 4 : 0);
      }
  expand_lanes(p);
}

#if defined(__AVX512BW__)
// AVX-512 versions of the Q4_K_M types' preparation (the same bytes as the loops above).
#define Q8K_SIMD_PREP 1

void prep_q4_k_simd(const uint8_t* b, Prepared* p) {
  p->d = f16(b);
  p->dm = f16(b + 2);
  // The 12 packed bytes -> 8 scales then 8 mins, one byte each (scale_min_k4 for all j).
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t mins_lo = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = mins_lo;
  u[0] &= low6;
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  // Each sub-block's scale / min covers two 16-value groups.
  _mm256_store_si256(reinterpret_cast<__m256i*>(p->scale),
                     _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(packed, packed)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(p->offset),
                     _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(packed, packed)));
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j));
    _mm256_store_si256(reinterpret_cast<__m256i*>(p->w + 64 * j), _mm256_and_si256(q, low));
    _mm256_store_si256(reinterpret_cast<__m256i*>(p->w + 64 * j + 32),
                       _mm256_and_si256(_mm256_srli_epi16(q, 4), low));
  }
  expand_lanes(p);
}

void prep_q6_k_simd(const uint8_t* b, Prepared* p) {
  p->d = p->dm = f16(b + 208);
  const __m256i sc = _mm256_cvtepi8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(p->scale), sc);
  _mm256_store_si256(reinterpret_cast<__m256i*>(p->offset), _mm256_slli_epi16(sc, 5));
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    // Bits 2s..2s+1 of each high byte, moved to bits 4..5.
    auto high = [&](int s) {
      return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), two), 4);
    };
    uint8_t* w = p->w + 128 * h;
    _mm256_store_si256(reinterpret_cast<__m256i*>(w),
                       _mm256_or_si256(_mm256_and_si256(l0, low), high(0)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + 32),
                       _mm256_or_si256(_mm256_and_si256(l1, low), high(1)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + 64),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), high(2)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + 96),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), high(3)));
  }
  expand_lanes(p);
}
#endif

using PrepFn = void (*)(const uint8_t*, Prepared*);

struct TypeInfo {
  PrepFn prep;
  int64_t type_size;
};

// Keyed by GGML type id (gguf.constants.GGMLQuantizationType).
TypeInfo type_info(int64_t qtype) {
#if defined(Q8K_SIMD_PREP)
  if (qtype == 12) return {prep_q4_k_simd, 144};
  if (qtype == 14) return {prep_q6_k_simd, 210};
#endif
  switch (qtype) {
    case 10: return {prep_q2_k, 84};
    case 11: return {prep_q3_k, 110};
    case 12: return {prep_q4_k, 144};
    case 13: return {prep_q5_k, 176};
    case 14: return {prep_q6_k, 210};
    default: TORCH_CHECK(false, "GGML type ", qtype, " has no Q8_K dot product");
  }
}

// Activations of one matmul, quantized: row r's block b at qs + r*k + 256b, d[r*nb + b],
// bsums + (r*nb + b)*16.
struct Q8K {
  const int8_t* qs;
  const float* d;
  const float* nbsum;  // -d * bsums, as float
  int64_t k, nb;
};

// y[i * ldy + j] = activation row r + i (i < R) . prepared weight row j (j < NB, at w + j*nb).
// Each weight load serves R activation rows, each activation load NB weight rows.
template <int NB, int R>
void dot_rows(const Prepared* w, const Q8K& a, int64_t r, float* y, int64_t ldy) {
  const int64_t nb = a.nb;
#if defined(__AVX512BW__)
  __m512 acc[R][NB];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i av[R][4];
    __m512 nbs[R];
    __m512 dab[R];
    for (int i = 0; i < R; ++i) {
      const int8_t* qs = a.qs + (r + i) * a.k + 256 * b;
      for (int c = 0; c < 4; ++c)
        av[i][c] = _mm512_loadu_si512(reinterpret_cast<const void*>(qs + 64 * c));
      nbs[i] = _mm512_loadu_ps(a.nbsum + ((r + i) * nb + b) * 16);
      dab[i] = _mm512_set1_ps(a.d[(r + i) * nb + b]);
    }
    for (int j = 0; j < NB; ++j) {
      const Prepared& p = w[j * nb + b];
      __m512i isum[R];
      for (int i = 0; i < R; ++i) isum[i] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i wq = _mm512_load_si512(reinterpret_cast<const void*>(p.w + 64 * c));
        const __m512i sc = _mm512_load_si512(reinterpret_cast<const void*>(p.lanes[c]));
        for (int i = 0; i < R; ++i) {
          const __m512i pairs = _mm512_maddubs_epi16(wq, av[i][c]);  // exact: |.| <= 2*63*127
#if defined(__AVX512VNNI__)
          isum[i] = _mm512_dpwssd_epi32(isum[i], pairs, sc);
#else
          isum[i] = _mm512_add_epi32(isum[i], _mm512_madd_epi16(pairs, sc));
#endif
        }
      }
      const __m512 moff = _mm512_load_ps(p.moff);
      const __m512 d = _mm512_set1_ps(p.d);
      for (int i = 0; i < R; ++i) {
        // da * d * isum + sum_g (-da * bsum[g]) * (dm * offset[g]), lane-wise.
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, dab[i]),
                                    acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(nbs[i], moff, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
#else
  for (int i = 0; i < R; ++i) {
    const int8_t* qs = a.qs + (r + i) * a.k;
    const float* da = a.d + (r + i) * nb;
    const float* nbs = a.nbsum + (r + i) * nb * 16;
    for (int j = 0; j < NB; ++j) {
      float sum = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const Prepared& p = w[j * nb + b];
        const int8_t* q = qs + 256 * b;
        int32_t isum = 0;
        float off = 0.f;
        for (int g = 0; g < 16; ++g) {
          int32_t s = 0;
          for (int l = 0; l < 16; ++l) s += (int32_t)p.w[16 * g + l] * q[16 * g + l];
          isum += p.scale[g] * s;
          off += nbs[16 * b + g] * p.moff[g];
        }
        sum += (float)isum * (p.d * da[b]) + off;
      }
      y[i * ldy + j] = sum;
    }
  }
#endif
}

// dot_rows for a run-time count of weight rows (1..kRowsPerTask).
template <int R>
void dot_rows_n(int64_t rows, const Prepared* w, const Q8K& a, int64_t r, float* y, int64_t ldy) {
  switch (rows) {
    case 8: dot_rows<8, R>(w, a, r, y, ldy); break;
    case 7: dot_rows<7, R>(w, a, r, y, ldy); break;
    case 6: dot_rows<6, R>(w, a, r, y, ldy); break;
    case 5: dot_rows<5, R>(w, a, r, y, ldy); break;
    case 4: dot_rows<4, R>(w, a, r, y, ldy); break;
    case 3: dot_rows<3, R>(w, a, r, y, ldy); break;
    case 2: dot_rows<2, R>(w, a, r, y, ldy); break;
    default: dot_rows<1, R>(w, a, r, y, ldy); break;
  }
}

constexpr int kRowsPerTask = 8;

// ---- Packed tiles: 16 weight rows interleaved, the output lanes are weight rows. ----
// A tile holds one 256-value block of 16 consecutive rows, its bytes a permutation of
// the 16 raw blocks (same memory): each field row-interleaved in 4-byte units, so one
// 64-byte load gives the same 4 bytes of all 16 rows. vpdpbusd then multiplies 4 quants
// of 16 rows by 4 activations broadcast to every lane: no preparation per call and no
// horizontal sums.
//   Q4_K tile (2304 bytes): d [16] fp16 | dmin [16] fp16 | scale bytes [3][16][4] |
//                           q [32][16][4]
//   Q5_K tile (2816 bytes): as Q4_K, with qh [8][16][4] before the quants
//   Q6_K tile (3360 bytes): d [16] fp16 | scales [4][16][4] | ql [32][16][4] | qh [16][16][4]
constexpr int64_t kQ4KTile = 2304, kQ5KTile = 2816, kQ6KTile = 3360;
enum class Tile { Q4K, Q5K, Q6K };
constexpr int64_t kPrefetchAhead = 1;  // tiles
constexpr int64_t kTaskRuns = 8;

#if defined(IE_TILE_SIMD)
#define Q8K_PACKED 1
using namespace ie_tile;

// body(tile bytes, tile index) for every tile of `tiles` (each `stride` bytes from base).
// Tasks are runs of consecutive tiles, so each thread streams through memory in order
// (fetching the next tile of its run while it computes: each is read once per step);
// kTaskRuns of them balance a thread that starts late.
template <class F>
void for_tile_runs(const uint8_t* base, int64_t tiles, int64_t stride, const F& body) {
  const int64_t run = std::max<int64_t>(1, (tiles + kTaskRuns - 1) / kTaskRuns);
  parallel_tasks((tiles + run - 1) / run, [&](int64_t task) {
    const int64_t first = task * run, last = std::min(tiles, first + run);
    for (int64_t tile = first; tile < last; ++tile) {
      const uint8_t* tp = base + tile * stride;
      if (tile + kPrefetchAhead < last)
        for (int64_t off = 0; off < stride; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tp + kPrefetchAhead * stride + off),
                       _MM_HINT_T0);
      body(tp, tile);
    }
  });
}

// Per (activation row, block) int16 pairs of bsum sums for the offset terms (see below).
struct PackedActs {
  const int8_t* qs;
  const float* d;
  const int32_t* pairs;  // [M, nb, 12]
  int64_t k, nb;
};

// acc[i] += the tile's block b for activation rows r0..r0+R.
// Q4_K, and Q5_K (Q5 = true: a fifth bit per value from qh, bit 2c / 2c + 1 of chunk c).
template <int R, bool Q5>
void q4k_tile_block(const uint8_t* t, const PackedActs& a, int64_t r0, int64_t b, vf* acc) {
  const vf d = half16(t);
  const vf dmin = half16(t + 32);
  // The 12 scale bytes of each row -> 8 scales (u0, u1) and 8 mins (u2, u3), a byte each.
  const vi x0 = load64(t + 64), x1 = load64(t + 128), x2 = load64(t + 192);
  const vi low6 = set1_i32(0x3f3f3f3f), low4 = set1_i32(0x0f0f0f0f);
  const vi low2 = set1_i32(0x03030303);
  const vi u[4] = {
      vand(x0, low6),
      vor(vand(x2, low4),
                      slli32(vand(srli32(x0, 6), low2), 4)),
      vand(x1, low6),
      vor(vand(srli32(x2, 4), low4),
                      slli32(vand(srli32(x1, 6), low2), 4))};
  const vi byte = set1_i32(0xFF), nib = set1_i8(0x0F);
  const uint8_t* q = t + (Q5 ? 768 : 256);
  const uint8_t* qh = t + 256;
  const vi one = set1_i8(0x01);
  vi isum[R];
  for (int i = 0; i < R; ++i) isum[i] = zero_i();
  for (int c = 0; c < 4; ++c) {
    vi lo_acc[R], hi_acc[R];
    for (int i = 0; i < R; ++i) lo_acc[i] = hi_acc[i] = zero_i();
    for (int v = 0; v < 8; ++v) {
      const vi w = load64(q + (8 * c + v) * 64);
      vi lo = vand(w, nib);
      vi hi = vand(srli16(w, 4), nib);
      if (Q5) {
        const vi h = load64(qh + v * 64);
        lo = vor(lo, slli16(
            vand(srli16(h, 2 * c), one), 4));
        hi = vor(hi, slli16(
            vand(srli16(h, 2 * c + 1), one), 4));
      }
      for (int i = 0; i < R; ++i) {
        const int8_t* x = a.qs + (r0 + i) * a.k + 256 * b + 64 * c + 4 * v;
        lo_acc[i] = dpbusd(lo_acc[i], lo, bcast4(x));
        hi_acc[i] = dpbusd(hi_acc[i], hi, bcast4(x + 32));
      }
    }
    // Sub-blocks 2c and 2c + 1: byte (2c) % 4 and (2c + 1) % 4 of u[c / 2].
    const vi s_lo = vand(srli32(u[c / 2], 16 * (c % 2)), byte);
    const vi s_hi = vand(srli32(u[c / 2], 16 * (c % 2) + 8), byte);
    for (int i = 0; i < R; ++i)
      isum[i] = add32(isum[i], add32(mullo32(lo_acc[i], s_lo),
                                                           mullo32(hi_acc[i], s_hi)));
  }
  // Mins: sum_s m[s] * (bsum[2s] + bsum[2s + 1]), int16 pairs (m[4t], m[4t+2]) and
  // (m[4t+1], m[4t+3]) against the activations' pairs of those sums.
  const vi even = set1_i32(0x00FF00FF);
  const vi m_a[2] = {vand(u[2], even), vand(u[3], even)};
  const vi m_b[2] = {vand(srli32(u[2], 8), even),
                          vand(srli32(u[3], 8), even)};
  for (int i = 0; i < R; ++i) {
    const int32_t* pr = a.pairs + ((r0 + i) * a.nb + b) * 12;
    vi msum = zero_i();
    for (int h = 0; h < 2; ++h) {
      msum = dpwssd(msum, m_a[h], set1_i32(pr[2 * h]));
      msum = dpwssd(msum, m_b[h], set1_i32(pr[2 * h + 1]));
    }
    const vf da = set1_f(a.d[(r0 + i) * a.nb + b]);
    acc[i] = fmadd(to_float(isum[i]), fmul(d, da), acc[i]);
    acc[i] = fnmadd(to_float(msum), fmul(dmin, da), acc[i]);
  }
}

template <int R>
void q6k_tile_block(const uint8_t* t, const PackedActs& a, int64_t r0, int64_t b, vf* acc) {
  const vf d = half16(t);
  vi sc[4];
  for (int j = 0; j < 4; ++j) sc[j] = load64(t + 32 + 64 * j);
  const uint8_t* ql = t + 288;
  const uint8_t* qh = t + 2336;
  const vi nib = set1_i8(0x0F), two = set1_i8(0x03);
  vi isum[R];
  for (int i = 0; i < R; ++i) isum[i] = zero_i();
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {
      for (int uh = 0; uh < 2; ++uh) {
        vi part[R];
        for (int i = 0; i < R; ++i) part[i] = zero_i();
        for (int v = 4 * uh; v < 4 * uh + 4; ++v) {
          // Values 128h + 32k + 4v ..: low or high nibbles of ql, two bits of qh, + 32.
          const vi l = load64(ql + (16 * h + 8 * (k & 1) + v) * 64);
          const vi hb = load64(qh + (8 * h + v) * 64);
          const vi lowbits = k < 2 ? vand(l, nib)
                                        : vand(srli16(l, 4), nib);
          const vi highbits = slli16(
              vand(srli16(hb, 2 * k), two), 4);
          const vi w = vor(lowbits, highbits);
          for (int i = 0; i < R; ++i) {
            const int8_t* x = a.qs + (r0 + i) * a.k + 256 * b + 128 * h + 32 * k + 4 * v;
            part[i] = dpbusd(part[i], w, bcast4(x));
          }
        }
        // Group g = 8h + 2k + uh: scale byte g % 4 of dword g / 4, sign-extended.
        const int g = 8 * h + 2 * k + uh;
        const vi s = srai32(slli32(sc[g / 4], 24 - 8 * (g % 4)), 24);
        for (int i = 0; i < R; ++i)
          isum[i] = add32(isum[i], mullo32(part[i], s));
      }
    }
  }
  // The stored +32: 32 * sum_g scale[g] * bsum[g], int16 pairs (sc[4j], sc[4j+2]) and
  // (sc[4j+1], sc[4j+3]) against the activations' bsum pairs.
  vi s_a[4], s_b[4];
  for (int j = 0; j < 4; ++j) {
    s_a[j] = srai16(slli16(sc[j], 8), 8);
    s_b[j] = srai16(sc[j], 8);
  }
  for (int i = 0; i < R; ++i) {
    const int32_t* pr = a.pairs + ((r0 + i) * a.nb + b) * 12 + 4;
    vi off = zero_i();
    for (int j = 0; j < 4; ++j) {
      off = dpwssd(off, s_a[j], set1_i32(pr[2 * j]));
      off = dpwssd(off, s_b[j], set1_i32(pr[2 * j + 1]));
    }
    const vi total = sub32(isum[i], slli32(off, 5));
    const vf da = set1_f(a.d[(r0 + i) * a.nb + b]);
    acc[i] = fmadd(to_float(total), fmul(d, da), acc[i]);
  }
}

// out[r0 + i, 16 tile + j] for R activation rows, every block of one tile of rows.
template <int R, Tile KIND>
void packed_rows(const uint8_t* tiles, int64_t tile_bytes, const PackedActs& a, int64_t r0,
                 float* out, int64_t ldy) {
  vf acc[R];
  for (int i = 0; i < R; ++i) acc[i] = zero_f();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* t = tiles + b * tile_bytes;
    if constexpr (KIND == Tile::Q6K) q6k_tile_block<R>(t, a, r0, b, acc);
    else q4k_tile_block<R, KIND == Tile::Q5K>(t, a, r0, b, acc);
  }
  for (int i = 0; i < R; ++i) store(out + (r0 + i) * ldy, acc[i]);
}

// ---- Q8_0 and Q4_0 weights: llama.cpp multiplies them by Q8_0 activations. ----
//   Q8_0 tile (544 bytes): d [16] fp16 | quants [8][16][4]
//   Q4_0 tile (288 bytes): d [16] fp16 | quant bytes [4][16][4] (low nibbles: values
//                          4v.., high: 16 + 4v..), values stored + 8
struct Q80Acts {
  const int8_t* qs;
  const float* d;      // [M, nb]: the fp16 scale, as float
  const int32_t* sums;  // [M, nb]: the sum of each block's 32 quants
  int64_t k, nb;
};

template <int R, bool Q4>
void q80_rows(const uint8_t* tiles, int64_t tile_bytes, const Q80Acts& a, int64_t r0,
              float* out, int64_t ldy) {
  const vi nib = set1_i8(0x0F);
  vf acc[R];
  for (int i = 0; i < R; ++i) acc[i] = zero_f();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* t = tiles + b * tile_bytes;
    const vf dw = half16(t);
    vi isum[R];
    for (int i = 0; i < R; ++i) isum[i] = zero_i();
    if constexpr (Q4) {
      for (int v = 0; v < 4; ++v) {
        const vi w = load64(t + 32 + 64 * v);
        const vi lo = vand(w, nib);
        const vi hi = vand(srli16(w, 4), nib);
        for (int i = 0; i < R; ++i) {
          const int8_t* x = a.qs + (r0 + i) * a.k + 32 * b + 4 * v;
          isum[i] = dpbusd(isum[i], lo, bcast4(x));
          isum[i] = dpbusd(isum[i], hi, bcast4(x + 16));
        }
      }
    } else {
      for (int v = 0; v < 8; ++v) {
        const vi w = load64(t + 32 + 64 * v);  // signed quants
        for (int i = 0; i < R; ++i)
          isum[i] = dpbssd_biased(isum[i], w, bcast4(a.qs + (r0 + i) * a.k + 32 * b + 4 * v));
      }
    }
    // The stored offset (8, or the bias dpbssd_biased added) times the block's activation sum.
    const int32_t offset = Q4 ? 8 : kSignedBias;
    for (int i = 0; i < R; ++i) {
      const int64_t rb = (r0 + i) * a.nb + b;
      const vi total = sub32(isum[i], set1_i32(offset * a.sums[rb]));
      acc[i] = fmadd(to_float(total), fmul(dw, set1_f(a.d[rb])), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) store(out + (r0 + i) * ldy, acc[i]);
}
#endif

// llama.cpp's x86 quantize_row_q8_0 for one row (k % 32 == 0): per 32 values the largest
// magnitude over 127, stored as fp16 (d holds it as float), quants round-half-even of
// x * (127 / max); sums: each block's quant sum.
void quantize_row_q8_0(const float* x, int64_t k, int8_t* qs, float* d, int32_t* sums) {
  for (int64_t b = 0; b < k / 32; ++b, x += 32, qs += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    d[b] = static_cast<float>(c10::Half(amax / 127.f));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(x[j] * id));
      qs[j] = static_cast<int8_t>(std::max(-128, std::min(127, q)));
      sum += qs[j];
    }
    sums[b] = sum;
  }
}

// Every row of x [M, K] float32 quantized by row_fn on the pool: (qs int8 [M, K], d float32
// [M, K / block], sums [M, K / sum_group] of type S).
template <typename S, class RowFn>
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, int64_t block, int64_t sum_group,
                                         const RowFn& row_fn) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % block == 0, "K=", k, " is not a multiple of ", block);
  auto qs = torch::empty({m, k}, torch::dtype(torch::kInt8));
  auto d = torch::empty({m, k / block}, torch::dtype(torch::kFloat32));
  auto sums = torch::empty({m, k / sum_group}, torch::dtype(c10::CppTypeToScalarType<S>::value));
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  int8_t* qp = qs.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  S* sp = sums.template data_ptr<S>();
  parallel_tasks(m, [&](int64_t r) {
    row_fn(xp + r * ldx, k, qp + r * k, dp + r * (k / block), sp + r * (k / sum_group));
  });
  return {qs, d, sums};
}

}  // namespace

// The shapes a packed matmul needs (quants [M, K], tiles [N/16, row_bytes] of
// row_bytes each, out float32 [M, N] with unit column stride); false if there is no work.
bool check_packed(const torch::Tensor& qs, const torch::Tensor& packed, const torch::Tensor& out,
                  int64_t row_bytes) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kInt8 && qs.is_contiguous());
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == row_bytes,
              "packed rows do not match K");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == qs.size(0) && out.size(1) == packed.size(0) * 16 &&
              out.stride(1) == 1 && out.scalar_type() == torch::kFloat32,
              "out: float32 [M, N], unit column stride");
  return qs.size(0) > 0 && packed.size(0) > 0;
}

// Whether the packed-tile matmuls exist in this build (AVX512-BW + VNNI, or AVX2 + FMA + F16C).
bool packed_available() {
#if defined(Q8K_PACKED)
  return true;
#else
  return false;
#endif
}

// out [M, N] float32 (unit column stride) = Q8_K activations . packed K-quant tiles
// (uint8 [N/16, nb * tile bytes], see above), qtype Q4_K (12) or Q6_K (14).
void q8k_packed_matmul_into(torch::Tensor qs, torch::Tensor d, torch::Tensor bsums,
                            torch::Tensor packed, int64_t qtype, torch::Tensor out) {
#if defined(Q8K_PACKED)
  TORCH_CHECK(qtype >= 12 && qtype <= 14, "packed tiles exist for Q4_K, Q5_K and Q6_K only");
  TORCH_CHECK(d.is_contiguous() && bsums.is_contiguous());
  const bool q6 = qtype == 14, q5 = qtype == 13;
  const int64_t tile_bytes = q6 ? kQ6KTile : (q5 ? kQ5KTile : kQ4KTile);
  const int64_t m = qs.size(0), k = qs.size(1), nb = k / 256, tiles = packed.size(0);
  if (!check_packed(qs, packed, out, nb * tile_bytes)) return;
  // Per (row, block): Q4_K's pair sums ps[s] = bsum[2s] + bsum[2s+1] as int16 pairs
  // (ps[4t], ps[4t+2]), (ps[4t+1], ps[4t+3]) for t = 0, 1; then Q6_K's bsum pairs
  // (bs[4j], bs[4j+2]), (bs[4j+1], bs[4j+3]) for j = 0..3.
  std::vector<int32_t> pairs(m * nb * 12);
  const int16_t* bp = bsums.data_ptr<int16_t>();
  auto pack2 = [](int v0, int v1) {
    return (int32_t)((uint32_t)(uint16_t)(int16_t)v0 | ((uint32_t)(uint16_t)(int16_t)v1 << 16));
  };
  for (int64_t rb = 0; rb < m * nb; ++rb) {
    const int16_t* bs = bp + rb * 16;
    int32_t* pr = pairs.data() + rb * 12;
    int ps[8];
    for (int s = 0; s < 8; ++s) ps[s] = bs[2 * s] + bs[2 * s + 1];
    for (int t = 0; t < 2; ++t) {
      pr[2 * t] = pack2(ps[4 * t], ps[4 * t + 2]);
      pr[2 * t + 1] = pack2(ps[4 * t + 1], ps[4 * t + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      pr[4 + 2 * j] = pack2(bs[4 * j], bs[4 * j + 2]);
      pr[4 + 2 * j + 1] = pack2(bs[4 * j + 1], bs[4 * j + 3]);
    }
  }
  const PackedActs a{qs.data_ptr<int8_t>(), d.data_ptr<float>(), pairs.data(), k, nb};
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  const int64_t ldy = out.stride(0);
  for_tile_runs(pp, tiles, nb * tile_bytes, [&](const uint8_t* tp, int64_t tile) {
    float* y = yp + tile * 16;
    int64_t r = 0;
    // Q6_K's unpacking is shared by 8 activation rows; Q4_K's and Q5_K's by 4 (registers).
    if (q6) {
      for (; r + 8 <= m; r += 8) packed_rows<8, Tile::Q6K>(tp, tile_bytes, a, r, y, ldy);
      for (; r + 4 <= m; r += 4) packed_rows<4, Tile::Q6K>(tp, tile_bytes, a, r, y, ldy);
      for (; r < m; ++r) packed_rows<1, Tile::Q6K>(tp, tile_bytes, a, r, y, ldy);
    } else if (q5) {
      for (; r + 4 <= m; r += 4) packed_rows<4, Tile::Q5K>(tp, tile_bytes, a, r, y, ldy);
      for (; r < m; ++r) packed_rows<1, Tile::Q5K>(tp, tile_bytes, a, r, y, ldy);
    } else {
      for (; r + 4 <= m; r += 4) packed_rows<4, Tile::Q4K>(tp, tile_bytes, a, r, y, ldy);
      for (; r < m; ++r) packed_rows<1, Tile::Q4K>(tp, tile_bytes, a, r, y, ldy);
    }
  });
#else
  TORCH_CHECK(false, "packed K-quant tiles need AVX512-BW + AVX512-VNNI, or AVX2 + FMA + F16C");
#endif
}

// x [M, K] float32 (rows contiguous) -> (qs int8 [M, K], d float32 [M, K/256],
// bsums int16 [M, K/16]): ggml's quantize_row_q8_K_ref on each row.
std::vector<torch::Tensor> quantize_q8k(torch::Tensor x) {
  return quantize_rows<int16_t>(x, 256, 16, quantize_row_q8k);
}

// out [M, N] float32 (rows may be strided: a column slice) = Q8_K activations (qs, d,
// bsums from quantize_q8k) . raw, raw [N, row_bytes] K-quant rows: llama.cpp's arithmetic.
void q8k_matmul_into(torch::Tensor qs, torch::Tensor d, torch::Tensor bsums, torch::Tensor raw,
                     int64_t qtype, torch::Tensor out) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous());
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kInt8 && qs.is_contiguous());
  TORCH_CHECK(d.is_contiguous() && bsums.is_contiguous());
  const TypeInfo t = type_info(qtype);
  const int64_t m = qs.size(0), k = qs.size(1), n = raw.size(0), nb = k / 256;
  TORCH_CHECK(raw.size(1) == nb * t.type_size, "row bytes do not match K");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 &&
              out.scalar_type() == torch::kFloat32, "out: float32 [M, N], unit column stride");
  if (m == 0 || n == 0) return;
  // -d * bsums per 16 activations, for the offset term's FMA.
  std::vector<float> nbsum(m * nb * 16);
  const float* dp = d.data_ptr<float>();
  const int16_t* bp = bsums.data_ptr<int16_t>();
  for (int64_t i = 0; i < m * nb * 16; ++i) nbsum[i] = -dp[i / 16] * (float)bp[i];
  const Q8K a{qs.data_ptr<int8_t>(), dp, nbsum.data(), k, nb};
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  const int64_t rb = raw.size(1), ldy = out.stride(0);
  float* yp = out.data_ptr<float>();
  const int64_t num_tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  // A task prepares kRowsPerTask weight rows (in L1) and runs every activation row on them.
  parallel_tasks(num_tasks, [&](int64_t task) {
    thread_local std::vector<Prepared> buf;
    if ((int64_t)buf.size() < kRowsPerTask * nb) buf.resize(kRowsPerTask * nb);
    const int64_t n0 = task * kRowsPerTask, rows = std::min<int64_t>(kRowsPerTask, n - n0);
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t b = 0; b < nb; ++b)
        t.prep(rp + (n0 + j) * rb + b * t.type_size, &buf[j * nb + b]);
    // Written straight into out (ldy apart), two activation rows at a time.
    int64_t r = 0;
    for (; r + 2 <= m; r += 2) dot_rows_n<2>(rows, buf.data(), a, r, yp + r * ldy + n0, ldy);
    if (r < m) dot_rows_n<1>(rows, buf.data(), a, r, yp + r * ldy + n0, ldy);
  });
}

// x [M, K] float32 (rows contiguous) -> (qs int8 [M, K], d float32 [M, K/32], sums int32
// [M, K/32]): llama.cpp's x86 quantize_row_q8_0 on each row.
std::vector<torch::Tensor> quantize_q8_0(torch::Tensor x) {
  return quantize_rows<int32_t>(x, 32, 32, quantize_row_q8_0);
}

// out [M, N] float32 (unit column stride) = Q8_0 activations . packed Q8_0 (8) or Q4_0 (2)
// tiles (uint8 [N/16, nb * tile bytes], see above).
void q80_packed_matmul_into(torch::Tensor qs, torch::Tensor d, torch::Tensor sums,
                            torch::Tensor packed, int64_t qtype, torch::Tensor out) {
#if defined(Q8K_PACKED)
  TORCH_CHECK(qtype == 8 || qtype == 2, "Q8_0 activations pair with Q8_0 and Q4_0 tiles");
  TORCH_CHECK(d.is_contiguous() && sums.is_contiguous());
  const bool q4 = qtype == 2;
  const int64_t tile_bytes = q4 ? 288 : 544;
  const int64_t m = qs.size(0), k = qs.size(1), nb = k / 32, tiles = packed.size(0);
  if (!check_packed(qs, packed, out, nb * tile_bytes)) return;
  const Q80Acts a{qs.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<int32_t>(), k, nb};
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  const int64_t ldy = out.stride(0);
  for_tile_runs(pp, tiles, nb * tile_bytes, [&](const uint8_t* tp, int64_t tile) {
    float* y = yp + tile * 16;
    int64_t r = 0;
    if (q4) {
      for (; r + 4 <= m; r += 4) q80_rows<4, true>(tp, tile_bytes, a, r, y, ldy);
      for (; r < m; ++r) q80_rows<1, true>(tp, tile_bytes, a, r, y, ldy);
    } else {
      for (; r + 4 <= m; r += 4) q80_rows<4, false>(tp, tile_bytes, a, r, y, ldy);
      for (; r < m; ++r) q80_rows<1, false>(tp, tile_bytes, a, r, y, ldy);
    }
  });
#else
  TORCH_CHECK(false, "packed Q8_0 / Q4_0 tiles need AVX512-BW + AVX512-VNNI, or AVX2 + FMA + F16C");
#endif
}

// x [M, K] float32 (rows contiguous) -> (qs int8 [M, K], d float32 [M, K/32], s float32
// [M, K/32]): llama.cpp's x86 quantize_row_q8_1 on each row (d, s: their fp16 values).
std::vector<torch::Tensor> quantize_q8_1(torch::Tensor x) {
  return quantize_rows<float>(x, 32, 32, ie_block32::quantize_row_q8_1);
}

// out [M, N] float32 (unit column stride) = Q8_0 / Q8_1 activations (qs, d, and s for
// Q8_1, else undefined) . raw rows [N, row_bytes] of a 32-value block type.
void block32_matmul_into(const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& s,
                         const torch::Tensor& raw, int64_t qtype, torch::Tensor& out) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous());
  const int64_t m = qs.size(0), k = qs.size(1), n = raw.size(0);
  TORCH_CHECK(raw.size(1) == k / 32 * ie_block32::type_size(qtype), "row bytes do not match K");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 &&
              out.scalar_type() == torch::kFloat32, "out: float32 [M, N], unit column stride");
  if (m == 0 || n == 0) return;
  ie_block32::matmul_into(qs.data_ptr<int8_t>(), d.data_ptr<float>(),
                          s.defined() ? s.data_ptr<float>() : nullptr, m, k,
                          raw.data_ptr<uint8_t>(), n, qtype, out.data_ptr<float>(),
                          out.stride(0));
}

// out [M, N] float32 (unit column stride) = Q8_K activations (qs, d) . raw IQ4_XS rows.
void iq4_xs_matmul_into(const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& raw,
                        torch::Tensor& out) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous());
  const int64_t m = qs.size(0), k = qs.size(1), n = raw.size(0);
  TORCH_CHECK(raw.size(1) == k / 256 * ie_block32::kIQ4XSBytes, "row bytes do not match K");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 &&
              out.scalar_type() == torch::kFloat32, "out: float32 [M, N], unit column stride");
  if (m == 0 || n == 0) return;
  ie_block32::iq4_xs_matmul_into(qs.data_ptr<int8_t>(), d.data_ptr<float>(), m, k,
                                 raw.data_ptr<uint8_t>(), n, out.data_ptr<float>(),
                                 out.stride(0));
}

namespace {

// Which activation rounding llama.cpp gives a weight type: Q8_K (K-quants), Q8_0 or Q8_1.
enum class ActKind { Q8K, Q8_0, Q8_1 };

ActKind act_kind(int64_t qtype) {
  if ((qtype >= 10 && qtype <= 14) || qtype == ie_block32::kIQ4_XS) return ActKind::Q8K;
  switch (ie_block32::acts_for(qtype)) {
    case ie_block32::Acts::Q8_0: return ActKind::Q8_0;
    case ie_block32::Acts::Q8_1: return ActKind::Q8_1;
    default: TORCH_CHECK(false, "GGML type ", qtype, " has no 8-bit activation dot product");
  }
  return ActKind::Q8K;
}

}  // namespace

// out [M, sum of parts' N] = x . each part into consecutive columns, one call per layer,
// x quantized once as llama.cpp does for the parts' type (all parts must share it):
// K-quant parts (raw rows, or packed tiles where packed[i]) against Q8_K(x); Q8_0, Q4_0
// (raw or packed), Q5_0, MXFP4, IQ4_NL against Q8_0(x); Q4_1, Q5_1 against Q8_1(x); IQ4_XS
// against Q8_K(x).
void q8k_parts_into(torch::Tensor x, std::vector<torch::Tensor> weights,
                    std::vector<int64_t> qtypes, std::vector<bool> packed, torch::Tensor out) {
  TORCH_CHECK(weights.size() == qtypes.size() && weights.size() == packed.size());
  TORCH_CHECK(!qtypes.empty(), "no parts");
  const ActKind kind = act_kind(qtypes[0]);
  for (int64_t t : qtypes)
    TORCH_CHECK(act_kind(t) == kind, "parts of types ", qtypes[0], " and ", t,
                " take different activation roundings (mixed activation types)");
  std::vector<torch::Tensor> q;
  if (kind == ActKind::Q8K) q = quantize_q8k(x);
  else if (kind == ActKind::Q8_0) q = quantize_q8_0(x);
  else q = quantize_q8_1(x);
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t n = packed[i] ? weights[i].size(0) * 16 : weights[i].size(0);
    auto cols = weights.size() == 1 ? out : out.narrow(1, col, n);
    if (qtypes[i] == ie_block32::kIQ4_XS) {
      iq4_xs_matmul_into(q[0], q[1], weights[i], cols);
    } else if (kind == ActKind::Q8K) {
      if (packed[i]) q8k_packed_matmul_into(q[0], q[1], q[2], weights[i], qtypes[i], cols);
      else q8k_matmul_into(q[0], q[1], q[2], weights[i], qtypes[i], cols);
    } else if (packed[i]) {
      q80_packed_matmul_into(q[0], q[1], q[2], weights[i], qtypes[i], cols);
    } else {
      block32_matmul_into(q[0], q[1], kind == ActKind::Q8_1 ? q[2] : torch::Tensor(),
                          weights[i], qtypes[i], cols);
    }
    col += n;
  }
  TORCH_CHECK(col == out.size(1), "the parts' rows do not add up to out's columns");
}

// y [M, N] float32 = Q8_K(x) . raw: quantize_q8k then q8k_matmul_into.
torch::Tensor ggml_linear_q8k(torch::Tensor x, torch::Tensor raw, int64_t qtype) {
  auto q = quantize_q8k(x);
  auto y = torch::empty({x.size(0), raw.size(0)}, x.options());
  q8k_matmul_into(q[0], q[1], q[2], raw, qtype, y);
  return y;
}

// A layer's parts for ie_q8_parts_linear_raw: the core's CPU decode step (which chains
// every layer of a decode step in C++) multiplies through it without Python.
struct Q8Linear {
  std::vector<torch::Tensor> weights;
  std::vector<int64_t> qtypes;
  std::vector<bool> packed;
  int64_t K, N;
};

// y [M, N] = Q(x) . parts^T for x [M, K] (rows ldx apart), y dense: q8k_parts_into on
// plain pointers (the core's CpuLinearEntry function; ctx is a Q8Linear).
extern "C" void ie_q8_parts_linear_raw(void* ctx, const float* x, int64_t ldx, int64_t M,
                                       float* y) {
  const auto* l = static_cast<const Q8Linear*>(ctx);
  auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  auto xt = torch::from_blob(const_cast<float*>(x), {M, l->K}, {ldx, 1}, opts);
  auto yt = torch::from_blob(y, {M, l->N}, opts);
  q8k_parts_into(xt, l->weights, l->qtypes, l->packed, yt);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Q8Linear>(m, "Q8Linear", pybind11::module_local())
      .def(pybind11::init([](std::vector<torch::Tensor> w, std::vector<int64_t> t,
                             std::vector<bool> p, int64_t K, int64_t N) {
        TORCH_CHECK(w.size() == t.size() && w.size() == p.size() && !w.empty(), "bad parts");
        return Q8Linear{std::move(w), std::move(t), std::move(p), K, N};
      }))
      .def("context", [](Q8Linear& l) { return reinterpret_cast<int64_t>(&l); });
  m.def("q8_parts_linear_address",
        []() { return reinterpret_cast<int64_t>(&ie_q8_parts_linear_raw); },
        "address of ie_q8_parts_linear_raw");
  m.def("quantize_q8k", torch::wrap_pybind_function(quantize_q8k), "quantize_q8k");
  m.def("quantize_q8_0", torch::wrap_pybind_function(quantize_q8_0), "quantize_q8_0");
  m.def("quantize_q8_1", torch::wrap_pybind_function(quantize_q8_1), "quantize_q8_1");
  m.def("ggml_linear_q8k", torch::wrap_pybind_function(ggml_linear_q8k), "ggml_linear_q8k");
  m.def("q8k_parts_into", torch::wrap_pybind_function(q8k_parts_into), "q8k_parts_into");
  m.def("packed_available", torch::wrap_pybind_function(packed_available), "packed_available");
  m.def("set_parallel_runner", torch::wrap_pybind_function(set_parallel_runner),
        "set_parallel_runner");
}
