// float64 exp on 4 lanes (AVX2 + FMA) or 8 (AVX-512), and CELU(0.1) from it:
// the float64 kernels' counterparts of simd_math.h's float32 functions (the
// AEV's radial and angular exponentials, the networks' activation).
//
// exp(u) = s (1 + q): s = 2^n, u = n ln2 + r with |r| <= ln2 / 2 (ln 2 split
// in two so that r is exact to ~1e-19), q = expm1(r) by its Taylor series to
// r^13 (truncation < 5e-18 relative), Horner in FMA: within 1 ulp of exp for
// u in [-708, 709]. Lanes below -708.39 give s = 0 (the float64 exp would be
// subnormal there; callers only use such values as "0"), lanes above 709
// saturate at exp(709), and exp() returns NaN lanes as NaN. The 4- and 8-lane
// versions do the same operations lane by lane: the same bits.
#pragma once

#include "common/simd_math.h"

#ifdef TF_SIMD_AVX2
namespace torchani_fast::simd {

namespace exp_log_f64 {
constexpr double kMin = -708.39, kMax = 709.0;  // kMax: n <= 1023, no inf
constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: (x + kRound) - kRound rounds x
constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
// expm1(r) = r + r^2 p(r): p's coefficients 1/13! .. 1/2 (Horner, highest first).
constexpr double kExpm1[12] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0,
                               1.0 / 3628800.0,    1.0 / 362880.0,    1.0 / 40320.0,
                               1.0 / 5040.0,       1.0 / 720.0,       1.0 / 120.0,
                               1.0 / 24.0,         1.0 / 6.0,         0.5};
}  // namespace exp_log_f64

TF_AVX2_INLINE void exp_parts(__m256d u, __m256d& s, __m256d& q) {
  using namespace exp_log_f64;
  const __m256d uc = _mm256_min_pd(_mm256_max_pd(u, _mm256_set1_pd(kMin)), _mm256_set1_pd(kMax));
  const __m256d round = _mm256_set1_pd(kRound);
  const __m256d n = _mm256_sub_pd(_mm256_fmadd_pd(uc, _mm256_set1_pd(kLog2e), round), round);
  const __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(kLn2Lo),
                                     _mm256_fnmadd_pd(n, _mm256_set1_pd(kLn2Hi), uc));
  __m256d p = _mm256_fmadd_pd(r, _mm256_set1_pd(kExpm1[0]), _mm256_set1_pd(kExpm1[1]));
  for (int i = 2; i < 12; ++i) p = _mm256_fmadd_pd(r, p, _mm256_set1_pd(kExpm1[i]));
  q = _mm256_fmadd_pd(_mm256_mul_pd(r, r), p, r);
  // 2^n: n + 1023 in the exponent field. n is integral and within [-1022, 1024],
  // so its low mantissa bits after adding kRound hold n exactly.
  const __m256i ni = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(n, round)),
                                      _mm256_castpd_si256(round));
  const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1023)), 52);
  s = _mm256_and_pd(_mm256_castsi256_pd(bits), _mm256_cmp_pd(u, _mm256_set1_pd(kMin), _CMP_GE_OQ));
}

TF_AVX512_INLINE void exp_parts(__m512d u, __m512d& s, __m512d& q) {
  using namespace exp_log_f64;
  const __mmask8 all = 0xFF;
  const __m512d lo = _mm512_mask_max_pd(u, all, u, _mm512_set1_pd(kMin));
  const __m512d uc = _mm512_mask_min_pd(lo, all, lo, _mm512_set1_pd(kMax));
  const __m512d round = _mm512_set1_pd(kRound);
  const __m512d n = _mm512_sub_pd(_mm512_fmadd_pd(uc, _mm512_set1_pd(kLog2e), round), round);
  const __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(kLn2Lo),
                                     _mm512_fnmadd_pd(n, _mm512_set1_pd(kLn2Hi), uc));
  __m512d p = _mm512_fmadd_pd(r, _mm512_set1_pd(kExpm1[0]), _mm512_set1_pd(kExpm1[1]));
  for (int i = 2; i < 12; ++i) p = _mm512_fmadd_pd(r, p, _mm512_set1_pd(kExpm1[i]));
  q = _mm512_fmadd_pd(_mm512_mul_pd(r, r), p, r);
  const __m512i ni = _mm512_sub_epi64(_mm512_castpd_si512(_mm512_add_pd(n, round)),
                                      _mm512_castpd_si512(round));
  const __m512i bits = _mm512_slli_epi64(_mm512_add_epi64(ni, _mm512_set1_epi64(1023)), 52);
  s = _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(u, _mm512_set1_pd(kMin), _CMP_GE_OQ),
                          _mm512_castsi512_pd(bits));
}

TF_AVX2_INLINE __m256d exp(__m256d u) {
  __m256d s, q;
  exp_parts(u, s, q);
  return _mm256_blendv_pd(_mm256_fmadd_pd(s, q, s), u, _mm256_cmp_pd(u, u, _CMP_UNORD_Q));
}

TF_AVX512_INLINE __m512d exp(__m512d u) {
  __m512d s, q;
  exp_parts(u, s, q);
  return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(u, u, _CMP_UNORD_Q), _mm512_fmadd_pd(s, q, s), u);
}

// CELU(0.1) and its derivative as PyTorch computes them in float64 (and
// ensemble_cpu.cpp's scalar celu_inplace): x where x > 0 or NaN (derivative
// 1), else 0.1 expm1(10 x), and the derivative 0.1 c exp(c x) with
// c = 1 / float32(0.1) (PyTorch's CELU backward). expm1 = (s - 1) + s q.
namespace celu_f64 {
constexpr double kAlpha = 0.1, kInvAlpha = 1.0 / kAlpha;
constexpr double kC = 1.0 / static_cast<double>(static_cast<float>(kAlpha)), kAlphaC = kAlpha * kC;
}  // namespace celu_f64

TF_AVX2_INLINE __m256d celu01(__m256d x, __m256d& deriv) {
  using namespace celu_f64;
  const __m256d one = _mm256_set1_pd(1.0);
  __m256d s, q, sd, qd;
  exp_parts(_mm256_mul_pd(x, _mm256_set1_pd(kInvAlpha)), s, q);
  exp_parts(_mm256_mul_pd(x, _mm256_set1_pd(kC)), sd, qd);
  const __m256d pos = _mm256_cmp_pd(x, _mm256_setzero_pd(), _CMP_NLE_UQ);
  deriv = _mm256_blendv_pd(_mm256_mul_pd(_mm256_set1_pd(kAlphaC), _mm256_fmadd_pd(sd, qd, sd)),
                           one, pos);
  const __m256d em1 = _mm256_fmadd_pd(s, q, _mm256_sub_pd(s, one));
  return _mm256_blendv_pd(_mm256_mul_pd(_mm256_set1_pd(kAlpha), em1), x, pos);
}

TF_AVX512_INLINE __m512d celu01(__m512d x, __m512d& deriv) {
  using namespace celu_f64;
  const __m512d one = _mm512_set1_pd(1.0);
  __m512d s, q, sd, qd;
  exp_parts(_mm512_mul_pd(x, _mm512_set1_pd(kInvAlpha)), s, q);
  exp_parts(_mm512_mul_pd(x, _mm512_set1_pd(kC)), sd, qd);
  const __mmask8 pos = _mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_NLE_UQ);
  deriv = _mm512_mask_blend_pd(
      pos, _mm512_mul_pd(_mm512_set1_pd(kAlphaC), _mm512_fmadd_pd(sd, qd, sd)), one);
  const __m512d em1 = _mm512_fmadd_pd(s, q, _mm512_sub_pd(s, one));
  return _mm512_mask_blend_pd(pos, _mm512_mul_pd(_mm512_set1_pd(kAlpha), em1), x);
}


// ---- The float64 AEV's functions (aev/vector_f64_*.h): log, and cos and sin
// on [0, pi] for the cosine cutoff. The 4- and 8-lane versions do the same
// operations lane by lane: the same bits.
namespace aev_f64 {
constexpr double kSqrt2 = 1.4142135623730951;
// ln m = 2 t + 2 t^3 p(t^2), t = (m - 1) / (m + 1), |t| <= 0.1716: p's
// coefficients 1/23 .. 1/3 (Horner, highest first; truncation < 1e-18 relative).
constexpr double kAtanh[11] = {1.0 / 23, 1.0 / 21, 1.0 / 19, 1.0 / 17, 1.0 / 15, 1.0 / 13,
                               1.0 / 11, 1.0 / 9,  1.0 / 7,  1.0 / 5,  1.0 / 3};
// sin v = v - v^3 p(v^2) for |v| <= pi / 2: p's coefficients -1/21!, 1/19!,
// .. 1/3! (Horner, highest first; truncation < 2e-18).
constexpr double kSin[10] = {-1.0 / 51090942171709440000.0, 1.0 / 121645100408832000.0,
                             -1.0 / 355687428096000.0,      1.0 / 1307674368000.0,
                             -1.0 / 6227020800.0,           1.0 / 39916800.0,
                             -1.0 / 362880.0,               1.0 / 5040.0,
                             -1.0 / 120.0,                  1.0 / 6.0};
// pi and pi / 2, each in two parts (hi the nearest double).
constexpr double kPiHi = 3.141592653589793, kPiLo = 1.2246467991473532e-16;
constexpr double kHalfPiHi = 1.5707963267948966, kHalfPiLo = 6.123233995736766e-17;
}  // namespace aev_f64

// ln x for x > 0 (x = m 2^e, m in [sqrt(1/2), sqrt(2)), the atanh series of
// m): within 2 ulp for normal x. x = 0 gives -1023 ln 2 (-709: exp(y log x)
// is 0 for y >= 1), not -inf; subnormal and negative x give meaningless
// finite values (the AEV never passes them but in unused lanes).
TF_AVX2_INLINE __m256d log(__m256d x) {
  using namespace aev_f64;
  const __m256i xi = _mm256_castpd_si256(x);
  const __m256d round = _mm256_set1_pd(exp_log_f64::kRound);
  // e + 1.5 2^52 as a double (e = the biased exponent - 1023 added to the
  // mantissa bits of 1.5 2^52: exact), so that e converts without AVX-512.
  const __m256i e_bits = _mm256_add_epi64(_mm256_srli_epi64(xi, 52),
                                          _mm256_sub_epi64(_mm256_castpd_si256(round),
                                                           _mm256_set1_epi64x(1023)));
  __m256d m = _mm256_castsi256_pd(
      _mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi64x(0x000fffffffffffffLL)),
                      _mm256_set1_epi64x(0x3ff0000000000000LL)));
  const __m256d big = _mm256_cmp_pd(m, _mm256_set1_pd(kSqrt2), _CMP_GT_OQ);
  m = _mm256_blendv_pd(m, _mm256_mul_pd(m, _mm256_set1_pd(0.5)), big);
  const __m256d one = _mm256_set1_pd(1.0);
  const __m256d ef = _mm256_add_pd(_mm256_sub_pd(_mm256_castsi256_pd(e_bits), round),
                                   _mm256_and_pd(big, one));
  const __m256d t = _mm256_div_pd(_mm256_sub_pd(m, one), _mm256_add_pd(m, one));
  const __m256d t2 = _mm256_mul_pd(t, t);
  __m256d p = _mm256_fmadd_pd(t2, _mm256_set1_pd(kAtanh[0]), _mm256_set1_pd(kAtanh[1]));
  for (int i = 2; i < 11; ++i) p = _mm256_fmadd_pd(t2, p, _mm256_set1_pd(kAtanh[i]));
  const __m256d twice_t = _mm256_add_pd(t, t);
  const __m256d ln_m = _mm256_fmadd_pd(_mm256_mul_pd(twice_t, t2), p, twice_t);
  return _mm256_fmadd_pd(ef, _mm256_set1_pd(exp_log_f64::kLn2Hi),
                         _mm256_fmadd_pd(ef, _mm256_set1_pd(exp_log_f64::kLn2Lo), ln_m));
}

TF_AVX512_INLINE __m512d log(__m512d x) {
  using namespace aev_f64;
  const __mmask8 all = 0xFF;
  const __m512i xi = _mm512_castpd_si512(x);
  const __m512d round = _mm512_set1_pd(exp_log_f64::kRound);
  const __m512i e_bits = _mm512_add_epi64(_mm512_maskz_srli_epi64(all, xi, 52),
                                          _mm512_sub_epi64(_mm512_castpd_si512(round),
                                                           _mm512_set1_epi64(1023)));
  __m512d m = _mm512_castsi512_pd(
      _mm512_or_si512(_mm512_and_si512(xi, _mm512_set1_epi64(0x000fffffffffffffLL)),
                      _mm512_set1_epi64(0x3ff0000000000000LL)));
  const __mmask8 big = _mm512_cmp_pd_mask(m, _mm512_set1_pd(kSqrt2), _CMP_GT_OQ);
  m = _mm512_mask_mul_pd(m, big, m, _mm512_set1_pd(0.5));
  const __m512d one = _mm512_set1_pd(1.0);
  const __m512d ef = _mm512_add_pd(_mm512_sub_pd(_mm512_castsi512_pd(e_bits), round),
                                   _mm512_maskz_mov_pd(big, one));
  const __m512d t = _mm512_div_pd(_mm512_sub_pd(m, one), _mm512_add_pd(m, one));
  const __m512d t2 = _mm512_mul_pd(t, t);
  __m512d p = _mm512_fmadd_pd(t2, _mm512_set1_pd(kAtanh[0]), _mm512_set1_pd(kAtanh[1]));
  for (int i = 2; i < 11; ++i) p = _mm512_fmadd_pd(t2, p, _mm512_set1_pd(kAtanh[i]));
  const __m512d twice_t = _mm512_add_pd(t, t);
  const __m512d ln_m = _mm512_fmadd_pd(_mm512_mul_pd(twice_t, t2), p, twice_t);
  return _mm512_fmadd_pd(ef, _mm512_set1_pd(exp_log_f64::kLn2Hi),
                         _mm512_fmadd_pd(ef, _mm512_set1_pd(exp_log_f64::kLn2Lo), ln_m));
}

// sin v for |v| <= pi / 2 (Taylor series to v^21).
TF_AVX2_INLINE __m256d sin_half_pi(__m256d v) {
  const __m256d v2 = _mm256_mul_pd(v, v);
  __m256d p = _mm256_fmadd_pd(v2, _mm256_set1_pd(aev_f64::kSin[0]), _mm256_set1_pd(aev_f64::kSin[1]));
  for (int i = 2; i < 10; ++i) p = _mm256_fmadd_pd(v2, p, _mm256_set1_pd(aev_f64::kSin[i]));
  return _mm256_fnmadd_pd(_mm256_mul_pd(v, v2), p, v);
}
TF_AVX512_INLINE __m512d sin_half_pi(__m512d v) {
  const __m512d v2 = _mm512_mul_pd(v, v);
  __m512d p = _mm512_fmadd_pd(v2, _mm512_set1_pd(aev_f64::kSin[0]), _mm512_set1_pd(aev_f64::kSin[1]));
  for (int i = 2; i < 10; ++i) p = _mm512_fmadd_pd(v2, p, _mm512_set1_pd(aev_f64::kSin[i]));
  return _mm512_fnmadd_pd(_mm512_mul_pd(v, v2), p, v);
}

// cos x and sin x for 0 <= x <= pi, as the float32 cos_sin_0_pi: through sin
// of pi/2 - x and of min(x, pi - x), each reduced with a two-part constant so
// that both keep their relative accuracy near their zeros.
TF_AVX2_INLINE void cos_sin_0_pi(__m256d x, __m256d& c, __m256d& s) {
  using namespace aev_f64;
  c = sin_half_pi(_mm256_add_pd(_mm256_sub_pd(_mm256_set1_pd(kHalfPiHi), x), _mm256_set1_pd(kHalfPiLo)));
  const __m256d pi_minus = _mm256_add_pd(_mm256_sub_pd(_mm256_set1_pd(kPiHi), x), _mm256_set1_pd(kPiLo));
  s = sin_half_pi(_mm256_min_pd(x, pi_minus));
}
TF_AVX512_INLINE void cos_sin_0_pi(__m512d x, __m512d& c, __m512d& s) {
  using namespace aev_f64;
  const __mmask8 all = 0xFF;
  c = sin_half_pi(_mm512_add_pd(_mm512_sub_pd(_mm512_set1_pd(kHalfPiHi), x), _mm512_set1_pd(kHalfPiLo)));
  const __m512d pi_minus = _mm512_add_pd(_mm512_sub_pd(_mm512_set1_pd(kPiHi), x), _mm512_set1_pd(kPiLo));
  s = sin_half_pi(_mm512_mask_min_pd(x, all, x, pi_minus));
}

}  // namespace torchani_fast::simd
#endif  // TF_SIMD_AVX2
