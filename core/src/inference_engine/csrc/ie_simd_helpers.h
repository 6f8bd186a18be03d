// Shared by the CPU attention kernels (namespace ie_simd): a 16-float vector type (vf16:
// one AVX-512 register, or two AVX2 registers) with the few operations the kernels use,
// float32 or bfloat16 loads widened to float32, a vectorised exp, an online-softmax step
// over a 16-key block and the probability-weighted sum of a block's values. The vector
// parts exist only where the compiler targets AVX-512F or AVX2 with FMA (IE_SIMD16).
#ifndef IE_SIMD_HELPERS_H
#define IE_SIMD_HELPERS_H

#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define IE_SIMD16 1
#endif

namespace ie_simd {
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
// ---- AVX-512: a vf16 is one register, a mask16 a mask register.
struct vf16 { __m512 v; };
using mask16 = __mmask16;
constexpr int VECTOR_REGISTERS = 32;
inline mask16 mask_bits(uint32_t bits) { return (mask16)bits; }
inline vf16 vzero() { return {_mm512_setzero_ps()}; }
inline vf16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline vf16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline vf16 vload(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline vf16 vload_masked(mask16 m, const float* p) { return {_mm512_maskz_loadu_ps(m, p)}; }
inline void vstore(float* p, vf16 a) { _mm512_storeu_ps(p, a.v); }
inline vf16 vadd(vf16 a, vf16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf16 vsub(vf16 a, vf16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf16 vmul(vf16 a, vf16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf16 vfmadd(vf16 a, vf16 b, vf16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vf16 vmask_zero(mask16 m, vf16 a) { return {_mm512_maskz_mov_ps(m, a.v)}; }
inline float vreduce_add(vf16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vreduce_max_masked(mask16 m, vf16 a) { return _mm512_mask_reduce_max_ps(m, a.v); }

// exp(x) for the softmax's x <= 0: 2^n * P(r) with r = x - n ln2, |r| <= ln2 / 2, P the
// degree-7 Taylor polynomial (relative error < 1e-8 before float rounding).
inline __m512 exp_poly(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203094172e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
inline vf16 vexp(vf16 x) { return {exp_poly(x.v)}; }

#elif defined(IE_SIMD16)
// ---- AVX2 + FMA: a vf16 is two 8-float registers, a mask16 two all-ones/zero lane masks.
struct vf16 { __m256 lo, hi; };
struct mask16 { __m256 lo, hi; };
constexpr int VECTOR_REGISTERS = 16;
inline mask16 mask_bits(uint32_t bits) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_set1_epi32((int)bits);
  const __m256i bh = _mm256_set1_epi32((int)(bits >> 8));
  return {_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lanes), lanes)),
          _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bh, lanes), lanes))};
}
inline vf16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf16 vset1(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline vf16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf16 vload(const at::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
inline vf16 vload_masked(mask16 m, const float* p) {
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)),
          _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}
inline void vstore(float* p, vf16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline vf16 vadd(vf16 a, vf16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf16 vsub(vf16 a, vf16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf16 vmul(vf16 a, vf16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf16 vfmadd(vf16 a, vf16 b, vf16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf16 vmask_zero(mask16 m, vf16 a) {
  return {_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)};
}
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float vreduce_add(vf16 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vreduce_max_masked(mask16 m, vf16 a) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const __m256 v = _mm256_max_ps(_mm256_blendv_ps(ninf, a.lo, m.lo),
                                 _mm256_blendv_ps(ninf, a.hi, m.hi));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for the softmax's x <= 0, as the AVX-512 form but clamped at -87 (2^n stays a
// normal float, built from its exponent bits; exp(-87) ~ 1.6e-38 is nothing beside the
// row maximum's 1).
inline __m256 exp_poly(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068203094172e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf16 vexp(vf16 x) { return {exp_poly(x.lo), exp_poly(x.hi)}; }
#endif

#ifdef IE_SIMD16
// Widened loads under the name the kernels use.
inline vf16 load16(const float* p) { return vload(p); }
inline vf16 load16(const at::BFloat16* p) { return vload(p); }

// Rows a register-blocked loop keeps at once: NV vectors per row must leave registers
// for the rest (AVX2 has half the registers of AVX-512, each half as wide).
constexpr int VALUE_ROWS = VECTOR_REGISTERS == 32 ? 4 : 2;

// One query row's online-softmax step over a 16-key block: s holds its scores (lanes
// outside mask are ignored); the row's running max m and sum l are updated, acc (NV * 16
// floats) rescaled, and the block's unnormalised probabilities stored to p_out (zero
// outside mask).
template <int NV>
inline void online_softmax_step(vf16 s, mask16 mask, float& m, float& l, float* p_out,
                                float* acc) {
  const float new_m = std::max(m, vreduce_max_masked(mask, s));
  const float alpha = std::exp(m - new_m);  // 0 for a row's first visible block
  const vf16 p = vmask_zero(mask, vexp(vsub(s, vset1(new_m))));
  vstore(p_out, p);
  l = l * alpha + vreduce_add(p);
  m = new_m;
  if (alpha != 1.f) {
    const vf16 av = vset1(alpha);
    for (int i = 0; i < NV; ++i) vstore(acc + 16 * i, vmul(vload(acc + 16 * i), av));
  }
}

// acc rows [0, n) (n <= 4, NV * 16 floats, d apart) += sum_tt probs[row * 16 + tt] * v_tt
// for the block's nt value rows (vt apart), accumulated in registers, VALUE_ROWS rows
// per pass over the values.
template <typename T, int NV>
inline void add_weighted_values(float* acc, int64_t d, const float* probs, int64_t n,
                                const T* v, int64_t vt, int64_t nt) {
  for (int64_t r0 = 0; r0 < n; r0 += VALUE_ROWS) {
    const int64_t rn = std::min<int64_t>(VALUE_ROWS, n - r0);
    vf16 o[VALUE_ROWS][NV];
    for (int64_t r = 0; r < rn; ++r)
      for (int i = 0; i < NV; ++i) o[r][i] = vload(acc + (r0 + r) * d + 16 * i);
    for (int64_t tt = 0; tt < nt; ++tt) {
      vf16 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16(v + tt * vt + 16 * i);
      for (int64_t r = 0; r < rn; ++r) {
        const vf16 pv = vset1(probs[(r0 + r) * 16 + tt]);
        for (int i = 0; i < NV; ++i) o[r][i] = vfmadd(pv, vv[i], o[r][i]);
      }
    }
    for (int64_t r = 0; r < rn; ++r)
      for (int i = 0; i < NV; ++i) vstore(acc + (r0 + r) * d + 16 * i, o[r][i]);
  }
}
#endif

}  // namespace ie_simd

#endif  // IE_SIMD_HELPERS_H
