// Shared by the CPU attention kernels (namespace ie_simd): float32 or bfloat16 loads widened
// to float32, a vectorised exp, an online-softmax step over a 16-key block and the
// probability-weighted sum of a block's values. The AVX-512 parts exist only where the
// compiler targets AVX-512F.
#ifndef IE_SIMD_HELPERS_H
#define IE_SIMD_HELPERS_H

#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ie_simd {
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) for the softmax's x <= 0: 2^n * P(r) with r = x - n ln2, |r| <= ln2 / 2, P the
// degree-7 Taylor polynomial (relative error < 1e-8 before float rounding).
inline __m512 exp16(__m512 x) {
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


// One query row's online-softmax step over a 16-key block: s holds its scores (lanes
// outside mask are ignored); the row's running max m and sum l are updated, acc (NV * 16
// floats) rescaled, and the block's unnormalised probabilities stored to p_out (zero
// outside mask).
template <int NV>
inline void online_softmax_step(__m512 s, __mmask16 mask, float& m, float& l, float* p_out,
                                float* acc) {
  const float new_m = std::max(m, _mm512_mask_reduce_max_ps(mask, s));
  const float alpha = std::exp(m - new_m);  // 0 for a row's first visible block
  const __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_m))));
  _mm512_storeu_ps(p_out, p);
  l = l * alpha + _mm512_reduce_add_ps(p);
  m = new_m;
  if (alpha != 1.f) {
    const __m512 av = _mm512_set1_ps(alpha);
    for (int i = 0; i < NV; ++i)
      _mm512_storeu_ps(acc + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), av));
  }
}

// acc rows [0, n) (n <= 4, NV * 16 floats, d apart) += sum_tt probs[row * 16 + tt] * v_tt
// for the block's nt value rows (vt apart), accumulated in registers.
template <typename T, int NV>
inline void add_weighted_values(float* acc, int64_t d, const float* probs, int64_t n,
                                const T* v, int64_t vt, int64_t nt) {
  __m512 o[4][NV];
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < NV; ++i) o[r][i] = _mm512_loadu_ps(acc + r * d + 16 * i);
  for (int64_t tt = 0; tt < nt; ++tt) {
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16(v + tt * vt + 16 * i);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 pv = _mm512_set1_ps(probs[r * 16 + tt]);
      for (int i = 0; i < NV; ++i) o[r][i] = _mm512_fmadd_ps(pv, vv[i], o[r][i]);
    }
  }
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + r * d + 16 * i, o[r][i]);
}
#endif

}  // namespace ie_simd

#endif  // IE_SIMD_HELPERS_H
