// The lane operations of the float64 AEV kernels (aev/vector_f64_body.h), once
// for 4 lanes (AVX2 + FMA: namespace x4) and once for 8 (AVX-512: x8), with
// the same names, so that one kernel source serves both widths. Each
// namespace also names its target attributes (TF_F64_FN / TF_F64_INLINE are
// defined to them just before the body is included).
#pragma once
// (Included by aev/vector_f64_cpu.cpp and aev/second_cpu.cpp, each time inside
// its TF_SIMD_AVX2 block and anonymous namespace; zero, hsum and gather serve
// the second derivatives' lanes, aev/second_lanes.h.)

namespace x4 {
using S = double;
using vd = __m256d;  // a vector of doubles
using md = __m256d;  // a lane mask
constexpr int64_t kLanes = 4;
TF_AVX2_INLINE vd ld(const double* p) { return _mm256_loadu_pd(p); }
TF_AVX2_INLINE void st(double* p, vd x) { _mm256_storeu_pd(p, x); }
TF_AVX2_INLINE vd bc(double x) { return _mm256_set1_pd(x); }
TF_AVX2_INLINE vd add(vd a, vd b) { return _mm256_add_pd(a, b); }
TF_AVX2_INLINE vd sub(vd a, vd b) { return _mm256_sub_pd(a, b); }
TF_AVX2_INLINE vd mul(vd a, vd b) { return _mm256_mul_pd(a, b); }
TF_AVX2_INLINE vd div(vd a, vd b) { return _mm256_div_pd(a, b); }
TF_AVX2_INLINE vd fma(vd a, vd b, vd c) { return _mm256_fmadd_pd(a, b, c); }    // a b + c
TF_AVX2_INLINE vd fnma(vd a, vd b, vd c) { return _mm256_fnmadd_pd(a, b, c); }  // c - a b
TF_AVX2_INLINE vd fms(vd a, vd b, vd c) { return _mm256_fmsub_pd(a, b, c); }    // a b - c
TF_AVX2_INLINE vd vsqrt(vd a) { return _mm256_sqrt_pd(a); }
TF_AVX2_INLINE vd vmax(vd a, vd b) { return _mm256_max_pd(a, b); }
TF_AVX2_INLINE md lt(vd a, vd b) { return _mm256_cmp_pd(a, b, _CMP_LT_OQ); }
TF_AVX2_INLINE md le(vd a, vd b) { return _mm256_cmp_pd(a, b, _CMP_LE_OQ); }
TF_AVX2_INLINE md gt(vd a, vd b) { return _mm256_cmp_pd(a, b, _CMP_GT_OQ); }
TF_AVX2_INLINE md ge(vd a, vd b) { return _mm256_cmp_pd(a, b, _CMP_GE_OQ); }
TF_AVX2_INLINE md eq(vd a, vd b) { return _mm256_cmp_pd(a, b, _CMP_EQ_OQ); }
TF_AVX2_INLINE md both(md a, md b) { return _mm256_and_pd(a, b); }
TF_AVX2_INLINE vd sel(md m, vd if_set, vd if_clear) { return _mm256_blendv_pd(if_clear, if_set, m); }
TF_AVX2_INLINE vd keep(md m, vd a) { return _mm256_and_pd(a, m); }  // 0 where m is clear
// The lanes below n.
TF_AVX2_INLINE md first(int64_t n) {
  return _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3)));
}
// acc += a b on 4 lanes (the order of the sums: aev/vector_f64_common.h).
TF_AVX2_INLINE void acc4(__m256d& acc, vd a, vd b) { acc = _mm256_fmadd_pd(a, b, acc); }
TF_AVX2_INLINE vd zero() { return _mm256_setzero_pd(); }
TF_AVX2_INLINE double hsum(vd v) {
  const __m128d x = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(x, _mm_unpackhi_pd(x, x)));
}
// base[offsets[j] + extra] in lane j.
TF_AVX2_INLINE vd gather(const double* base, const int32_t* offsets, int32_t extra) {
  const __m128i at = _mm_add_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offsets)),
                                   _mm_set1_epi32(extra));
  return _mm256_i32gather_pd(base, at, 8);
}
}  // namespace x4

namespace x8 {
using S = double;
using vd = __m512d;
using md = __mmask8;
constexpr int64_t kLanes = 8;
TF_AVX512_INLINE vd ld(const double* p) { return _mm512_loadu_pd(p); }
TF_AVX512_INLINE void st(double* p, vd x) { _mm512_storeu_pd(p, x); }
TF_AVX512_INLINE vd bc(double x) { return _mm512_set1_pd(x); }
TF_AVX512_INLINE vd add(vd a, vd b) { return _mm512_add_pd(a, b); }
TF_AVX512_INLINE vd sub(vd a, vd b) { return _mm512_sub_pd(a, b); }
TF_AVX512_INLINE vd mul(vd a, vd b) { return _mm512_mul_pd(a, b); }
TF_AVX512_INLINE vd div(vd a, vd b) { return _mm512_div_pd(a, b); }
TF_AVX512_INLINE vd fma(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
TF_AVX512_INLINE vd fnma(vd a, vd b, vd c) { return _mm512_fnmadd_pd(a, b, c); }
TF_AVX512_INLINE vd fms(vd a, vd b, vd c) { return _mm512_fmsub_pd(a, b, c); }
TF_AVX512_INLINE vd vsqrt(vd a) { return _mm512_sqrt_pd(a); }
TF_AVX512_INLINE vd vmax(vd a, vd b) { return _mm512_mask_max_pd(a, 0xFF, a, b); }
TF_AVX512_INLINE md lt(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_LT_OQ); }
TF_AVX512_INLINE md le(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_LE_OQ); }
TF_AVX512_INLINE md gt(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_GT_OQ); }
TF_AVX512_INLINE md ge(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_GE_OQ); }
TF_AVX512_INLINE md eq(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_EQ_OQ); }
TF_AVX512_INLINE md both(md a, md b) { return static_cast<md>(a & b); }
TF_AVX512_INLINE vd sel(md m, vd if_set, vd if_clear) { return _mm512_mask_blend_pd(m, if_clear, if_set); }
TF_AVX512_INLINE vd keep(md m, vd a) { return _mm512_maskz_mov_pd(m, a); }
TF_AVX512_INLINE md first(int64_t n) {
  return static_cast<md>(n >= 8 ? 0xFF : n <= 0 ? 0 : (1u << n) - 1);
}
// acc += a b on 4 lanes: the low half, then the high half (the 4-lane order).
TF_AVX512_INLINE void acc4(__m256d& acc, vd a, vd b) {
  acc = _mm256_fmadd_pd(_mm512_castpd512_pd256(a), _mm512_castpd512_pd256(b), acc);
  acc = _mm256_fmadd_pd(_mm512_extractf64x4_pd(a, 1), _mm512_extractf64x4_pd(b, 1), acc);
}
TF_AVX512_INLINE vd zero() { return _mm512_setzero_pd(); }
TF_AVX512_INLINE double hsum(vd v) { return _mm512_reduce_add_pd(v); }
TF_AVX512_INLINE vd gather(const double* base, const int32_t* offsets, int32_t extra) {
  const __m256i at = _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets)),
                                      _mm256_set1_epi32(extra));
  return _mm512_i32gather_pd(at, base, 8);
}
}  // namespace x8
