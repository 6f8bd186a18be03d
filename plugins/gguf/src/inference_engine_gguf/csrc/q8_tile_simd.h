// 64-byte vectors for the packed-tile kernels of q8k_matmul.cpp (namespace ie_tile): a tile
// unit is 4 bytes of 16 weight rows, so one vector holds 16 int32 or float lanes, one per
// row. With AVX512-BW + VNNI a vector is one register and the products are vpdpbusd /
// vpdpwssd; with AVX2 (+ FMA, F16C) it is two registers and the products are
// vpmaddubsw + vpmaddwd, exact under the callers' bound (unsigned weight bytes <= 63
// against activations in [-127, 127]: pair sums <= 16002, no int16 saturation).
// IE_TILE_SIMD is defined where one of the two exists.
#ifndef IE_Q8_TILE_SIMD_H
#define IE_Q8_TILE_SIMD_H

#include <cstdint>
#include <cstring>
#if (defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define IE_TILE_SIMD 1
#endif

namespace ie_tile {

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
struct vi { __m512i v; };
struct vf { __m512 v; };
inline vi load64(const uint8_t* p) { return {_mm512_loadu_si512(reinterpret_cast<const void*>(p))}; }
inline vi zero_i() { return {_mm512_setzero_si512()}; }
inline vi set1_i32(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline vi set1_i8(int8_t x) { return {_mm512_set1_epi8(x)}; }
inline vi bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return set1_i32(v);
}
inline vi vand(vi a, vi b) { return {_mm512_and_si512(a.v, b.v)}; }
inline vi vor(vi a, vi b) { return {_mm512_or_si512(a.v, b.v)}; }
inline vi vxor(vi a, vi b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline vi srli32(vi a, int n) { return {_mm512_srli_epi32(a.v, n)}; }
inline vi slli32(vi a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline vi srai32(vi a, int n) { return {_mm512_srai_epi32(a.v, n)}; }
inline vi srli16(vi a, int n) { return {_mm512_srli_epi16(a.v, n)}; }
inline vi slli16(vi a, int n) { return {_mm512_slli_epi16(a.v, n)}; }
inline vi srai16(vi a, int n) { return {_mm512_srai_epi16(a.v, n)}; }
inline vi add32(vi a, vi b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline vi sub32(vi a, vi b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline vi mullo32(vi a, vi b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
// acc + sums of 4 products of unsigned bytes u and signed bytes s, per int32 lane.
inline vi dpbusd(vi acc, vi u, vi s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
// acc + sums of 2 products of int16 pairs, per int32 lane.
inline vi dpwssd(vi acc, vi a, vi b) { return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)}; }
// acc + sums of 4 products (a + kSignedBias) * b of signed bytes: a flipped to unsigned
// (a + 128) for vpdpbusd; the caller takes kSignedBias * sum(b) off.
constexpr int32_t kSignedBias = 128;
inline vi dpbssd_biased(vi acc, vi a, vi b) {
  return dpbusd(acc, vxor(a, set1_i8((int8_t)0x80)), b);
}
inline vf zero_f() { return {_mm512_setzero_ps()}; }
inline vf set1_f(float x) { return {_mm512_set1_ps(x)}; }
inline vf half16(const uint8_t* p) {  // 16 IEEE halves at p
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline vf to_float(vi a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline vf fmul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vf fnmadd(vf a, vf b, vf c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline void store(float* p, vf a) { _mm512_storeu_ps(p, a.v); }

#elif defined(IE_TILE_SIMD)
struct vi { __m256i lo, hi; };
struct vf { __m256 lo, hi; };
inline __m256i ld32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline vi load64(const uint8_t* p) { return {ld32(p), ld32(p + 32)}; }
inline vi zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi set1_i32(int32_t x) { const __m256i v = _mm256_set1_epi32(x); return {v, v}; }
inline vi set1_i8(int8_t x) { const __m256i v = _mm256_set1_epi8(x); return {v, v}; }
inline vi bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return set1_i32(v);
}
#define IE_TILE_OP2(name, intrinsic) \
  inline vi name(vi a, vi b) { return {intrinsic(a.lo, b.lo), intrinsic(a.hi, b.hi)}; }
#define IE_TILE_SHIFT(name, intrinsic) \
  inline vi name(vi a, int n) { return {intrinsic(a.lo, n), intrinsic(a.hi, n)}; }
IE_TILE_OP2(vand, _mm256_and_si256)
IE_TILE_OP2(vor, _mm256_or_si256)
IE_TILE_OP2(vxor, _mm256_xor_si256)
IE_TILE_OP2(add32, _mm256_add_epi32)
IE_TILE_OP2(sub32, _mm256_sub_epi32)
IE_TILE_OP2(mullo32, _mm256_mullo_epi32)
IE_TILE_SHIFT(srli32, _mm256_srli_epi32)
IE_TILE_SHIFT(slli32, _mm256_slli_epi32)
IE_TILE_SHIFT(srai32, _mm256_srai_epi32)
IE_TILE_SHIFT(srli16, _mm256_srli_epi16)
IE_TILE_SHIFT(slli16, _mm256_slli_epi16)
IE_TILE_SHIFT(srai16, _mm256_srai_epi16)
#undef IE_TILE_OP2
#undef IE_TILE_SHIFT
inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // exact under the bound above
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline vi dpbusd(vi acc, vi u, vi s) { return {dpbusd8(acc.lo, u.lo, s.lo), dpbusd8(acc.hi, u.hi, s.hi)}; }
inline vi dpwssd(vi acc, vi a, vi b) {
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
// Signed bytes a and b: |a| against b with a's sign (|a| <= 128, |b| <= 127: pair sums
// <= 32512, exact), so no bias.
constexpr int32_t kSignedBias = 0;
inline __m256i dpbssd8(__m256i acc, __m256i a, __m256i b) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline vi dpbssd_biased(vi acc, vi a, vi b) {
  return {dpbssd8(acc.lo, a.lo, b.lo), dpbssd8(acc.hi, a.hi, b.hi)};
}
inline vf zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1_f(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline vf half16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline vf to_float(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline vf fmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf fnmadd(vf a, vf b, vf c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline void store(float* p, vf a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
#endif

}  // namespace ie_tile

#endif  // IE_Q8_TILE_SIMD_H
