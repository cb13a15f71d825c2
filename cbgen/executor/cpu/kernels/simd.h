// A minimal float32 SIMD layer (AVX-512, or AVX2 with FMA) shared by the kernels that
// compile with -march=native: kWidth lanes of `vfloat` and a handful of operations on
// them, with kWidth = 0 where neither instruction set is enabled (callers then take
// their scalar loops). Included by more than one source, so everything here has
// internal linkage.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__)
// The sum of 8 float32 lanes (the AVX2 builds of the row kernels, and vsum below).
inline float hsum256(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// ---- a minimal float SIMD layer -------------------------------------------------
#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm512_storeu_ps(p, x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline float vsum(vfloat x) { return _mm512_reduce_add_ps(x); }
inline float vhmax(vfloat x) { return _mm512_reduce_max_ps(x); }
// bfloat16 -> float32 is a 16-bit left shift of the bit pattern.
inline vfloat vload_bf16(const void* p) {
  __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vfloat vround(vfloat x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vfloat vpow2i(vfloat n) {  // 2^n for integral n in the normal range
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(bits);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm256_storeu_ps(p, x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline float vsum(vfloat x) { return hsum256(x); }
inline float vhmax(vfloat x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vfloat vload_bf16(const void* p) {
  __m128i raw = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vfloat vround(vfloat x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vfloat vpow2i(vfloat n) {
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(bits);
}
#else
constexpr int64_t kWidth = 0;  // no SIMD: every loop below takes its scalar path
#endif

// Whether vfloat and the operations below exist (kWidth > 0), for preprocessor guards.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define CBGEN_VFLOAT 1
#else
#define CBGEN_VFLOAT 0
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// exp(x) for x <= 0 (softmax after subtracting the max): Cephes' expf, about 1 ulp.
// Inputs below -87.3 return 0 rather than a denormal, as expf would round them anyway.
inline vfloat vexp(vfloat x) {
  const vfloat lo = vset1(-87.33654f);
  vfloat clamped = vmax(x, lo);
  vfloat n = vround(vmul(clamped, vset1(1.44269504088896341f)));
  vfloat r = vfma(n, vset1(-0.693359375f), clamped);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vfloat y = vset1(1.9875691500e-4f);
  y = vfma(y, r, vset1(1.3981999507e-3f));
  y = vfma(y, r, vset1(8.3334519073e-3f));
  y = vfma(y, r, vset1(4.1665795894e-2f));
  y = vfma(y, r, vset1(1.6666665459e-1f));
  y = vfma(y, r, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(r, r), vadd(r, vset1(1.f)));
  vfloat out = vmul(y, vpow2i(n));
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), out);
#else
  return _mm256_and_ps(out, _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
#endif
}
#endif

#if CBGEN_VFLOAT
inline vfloat vdiv(vfloat a, vfloat b) {
#if defined(__AVX512F__)
  return _mm512_div_ps(a, b);
#else
  return _mm256_div_ps(a, b);
#endif
}

inline vfloat vneg_abs(vfloat x) {  // -|x|: the sign bit set
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x),
                                             _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
#else
  return _mm256_or_ps(x, _mm256_set1_ps(-0.f));
#endif
}

// if_negative where x < 0, otherwise elsewhere (NaN counts as not negative).
inline vfloat vwhere_negative(vfloat x, vfloat if_negative, vfloat otherwise) {
#if defined(__AVX512F__)
  return _mm512_mask_mov_ps(otherwise, _mm512_cmp_ps_mask(x, vzero(), _CMP_LT_OQ), if_negative);
#else
  return _mm256_blendv_ps(otherwise, if_negative, _mm256_cmp_ps(x, vzero(), _CMP_LT_OQ));
#endif
}

// Stores kWidth floats as bfloat16 rounded to nearest even, bit for bit as
// c10::BFloat16's conversion rounds them (NaN becomes 0x7FC0, denormals are kept;
// AVX512-BF16's vcvtneps2bf16 would flush them).
inline void vstore_bf16(void* dst, vfloat x) {
#if defined(__AVX512F__)
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                                         _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(static_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(rounded));
#else
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16),
                                                         _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                               _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  // Each value is below 2^16: packing with unsigned saturation keeps it, per 128-bit
  // half, and the permute puts the halves' four words side by side.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(static_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
#endif
}
#endif

}  // namespace
