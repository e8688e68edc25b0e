// The CPU kernels' instruction-set level (level(), have_avx2(), have_avx512():
// what the CPU has, capped by torchani_fast.cpu_isa()), and float32 exp and
// log on 8 lanes (AVX2 + FMA) or 16 (AVX-512) for their hot loops: the AEV's
// radial and angular terms (aev/aev_cpu.cpp) and CELU and GELU (celu01, gelu,
// with erf: the networks' products in ensemble/gemm.h, and ensemble/ensemble_cpu.cpp). glibc's scalar expf/powf
// cost 5-20 ns a value; these about 1 ns.
//
// Accuracy: exp within 2 ulp; log within 2 ulp of ln x for normal x; powers as
// exp(y log x) carry |y| times log's absolute error (about 1e-6 relative at
// y = 14, the ANI angular zeta), far below the float32 AEV's own rounding in
// the sums. Functions carry the target attribute themselves; call them only
// after have_avx2() (the 16-lane ones after have_avx512()), and not from
// lambdas (GCC does not give a lambda its enclosing function's target).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TF_SIMD_AVX2 1
#define TF_AVX2 __attribute__((target("avx2,fma")))
#define TF_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
// The networks' matrix products (ensemble/gemm.h) also have an AVX-512 version.
#define TF_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")))
#define TF_AVX512_INLINE \
  __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma"), always_inline)) inline
#endif

#include <atomic>

namespace torchani_fast::simd {

// Instruction sets of the CPU kernels, in order: 0 none (portable C++),
// 1 AVX2 + FMA, 2 AVX-512 (F, VL, DQ, BW) for the networks' products, the
// AEV's exp and log and the neighbour search.
constexpr int kScalar = 0, kAvx2 = 1, kAvx512 = 2;

// What this CPU (and its OS) supports.
inline int detected_level() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const int level = [] {
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return kScalar;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
      return kAvx512;
    return kAvx2;
  }();
  return level;
#else
  return kScalar;
#endif
}

// The highest level the kernels may use (torchani_fast.cpu_isa(); tests run
// every path this CPU has). Set it between calls, not while ops run.
inline std::atomic<int>& level_cap() {
  static std::atomic<int> cap{kAvx512};
  return cap;
}

inline int level() {
  const int cap = level_cap().load(std::memory_order_relaxed);
  return detected_level() < cap ? detected_level() : cap;
}

inline bool have_avx2() { return level() >= kAvx2; }
inline bool have_avx512() { return level() >= kAvx512; }

// While in scope, this thread's SSE/AVX arithmetic flushes denormal results to
// zero and reads denormal inputs as zero (MXCSR FTZ and DAZ); the caller's
// mode comes back at the end of the scope. For the float32 kernels only (the
// AEV, its first and second derivatives, the networks op): their denormals
// (AEV terms and CELU derivatives below 1.2e-38, 30 orders of magnitude under
// anything that can change an energy, a force or a Hessian) each cost a
// microcode assist; the AEV of 1hz5 (973 atoms) has 362 of them.
//
// Flushing never empties an AEV block that has a neighbour: the float32 cutoff
// stays above 1e-14 one step below Rc (aev_math::cutoff_tail), so such a block
// keeps a term above 1e-29 (the networks skip only all-zero blocks; tested in
// test_cutoff_tail_is_accurate). Every thread of a parallel region sets its
// own mode (it is per thread), so results depend neither on the caller's mode
// nor on the thread count. `enable` false (the float64 kernels) leaves the
// mode alone.
class FlushDenormals {
 public:
  explicit FlushDenormals(bool enable = true) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (!enable) return;
    saved_ = __builtin_ia32_stmxcsr();
    active_ = true;
    __builtin_ia32_ldmxcsr(saved_ | kFtzDaz);
#else
    (void)enable;
#endif
  }
  ~FlushDenormals() {
#if defined(__x86_64__) && defined(__GNUC__)
    if (active_) __builtin_ia32_ldmxcsr(saved_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  static constexpr unsigned kFtzDaz = 0x8040;  // bit 15 flush to zero, bit 6 denormals are zero
  unsigned saved_ = 0;
  bool active_ = false;
};

}  // namespace torchani_fast::simd

#if defined(__x86_64__) && defined(__GNUC__)
namespace torchani_fast::simd {

// The constants of exp_parts and log, one copy for their 8- and 16-lane
// versions (the same constants and operations give the same bits).
namespace exp_log {
constexpr float kMin = -87.0f, kMax = 88.0f;  // exp_parts clamps u to [kMin, kMax],
constexpr float kZeroBelow = -87.3f;          // and gives s = 0 below kZeroBelow
constexpr float kRound = 12582912.0f;         // 1.5 * 2^23: (x + kRound) - kRound rounds x
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860676533018672e-6f;  // ln 2 = hi + lo
// expm1(r) = r + r^2 p(r), p's coefficients from r^5 down (Horner).
constexpr float kExpm1[6] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f};
constexpr float kSqrt2 = 1.41421356237f;
// ln m = 2 t + 2 t^3 p(t^2), t = (m - 1) / (m + 1), p's coefficients from t^8 down.
constexpr float kAtanh[5] = {1.0f / 11, 1.0f / 9, 1.0f / 7, 1.0f / 5, 1.0f / 3};
}  // namespace exp_log

// exp(u) = s (1 + q): s = 2^n, q = expm1(r), u = n ln2 + r, |r| <= ln2 / 2
// (Taylor series of expm1 to r^7: relative error < 1e-8). Lanes below -87.3
// give s = 0 (exp underflows to 0 in float32), lanes above 88 saturate, NaN
// lanes give s = 0 (exp() below returns them as NaN).
TF_AVX2_INLINE void exp_parts(__m256 u, __m256& s, __m256& q) {
  using namespace exp_log;
  const __m256 lo = _mm256_set1_ps(kMin);
  const __m256 uc = _mm256_min_ps(_mm256_max_ps(u, lo), _mm256_set1_ps(kMax));
  const __m256 round = _mm256_set1_ps(kRound);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(uc, _mm256_set1_ps(kLog2e), round), round);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), uc));
  __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(kExpm1[0]), _mm256_set1_ps(kExpm1[1]));
  for (int i = 2; i < 6; ++i) p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(kExpm1[i]));
  q = _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r);
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  s = _mm256_and_ps(_mm256_castsi256_ps(bits),
                    _mm256_cmp_ps(u, _mm256_set1_ps(kZeroBelow), _CMP_GE_OQ));
}

// exp_parts of N vectors, each step done for all N before the next (N
// independent chains side by side, in program order, for the out-of-order
// core): the same operations as exp_parts, lane by lane, so the same bits.
// (GCC 12 warns that its own AVX-512 headers read an uninitialised value, the
// `_mm512_undefined_*()` source of an unmasked operation; the masked forms
// with every lane set below are the same instructions without the warning.)
template <int N>
TF_AVX512_INLINE void exp_parts_n(const __m512 (&u)[N], __m512 (&s)[N], __m512 (&q)[N]) {
  using namespace exp_log;
  const __mmask16 all = 0xFFFF;
  __m512 n[N], r[N], p[N];
  const __m512 round = _mm512_set1_ps(kRound);
  for (int i = 0; i < N; ++i) {
    const __m512 lo = _mm512_mask_max_ps(u[i], all, u[i], _mm512_set1_ps(kMin));
    r[i] = _mm512_mask_min_ps(lo, all, lo, _mm512_set1_ps(kMax));  // (uc of exp_parts)
  }
  for (int i = 0; i < N; ++i)
    n[i] = _mm512_sub_ps(_mm512_fmadd_ps(r[i], _mm512_set1_ps(kLog2e), round), round);
  for (int i = 0; i < N; ++i)
    r[i] = _mm512_fnmadd_ps(n[i], _mm512_set1_ps(kLn2Lo),
                            _mm512_fnmadd_ps(n[i], _mm512_set1_ps(kLn2Hi), r[i]));
  for (int i = 0; i < N; ++i)
    p[i] = _mm512_fmadd_ps(r[i], _mm512_set1_ps(kExpm1[0]), _mm512_set1_ps(kExpm1[1]));
  for (int j = 2; j < 6; ++j)
    for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(r[i], p[i], _mm512_set1_ps(kExpm1[j]));
  for (int i = 0; i < N; ++i) {
    q[i] = _mm512_fmadd_ps(_mm512_mul_ps(r[i], r[i]), p[i], r[i]);
    const __m512i ni = _mm512_mask_cvtps_epi32(_mm512_setzero_si512(), all, n[i]);
    const __m512i bits = _mm512_mask_slli_epi32(_mm512_setzero_si512(), all,
                                                _mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23);
    s[i] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u[i], _mm512_set1_ps(kZeroBelow), _CMP_GE_OQ),
                               _mm512_castsi512_ps(bits));
  }
}

// exp_parts on 16 lanes.
TF_AVX512_INLINE void exp_parts(__m512 u, __m512& s, __m512& q) {
  __m512 uv[1] = {u}, sv[1], qv[1];
  exp_parts_n(uv, sv, qv);
  s = sv[0];
  q = qv[0];
}

// CELU with alpha = 0.1 (ANI's activation), lane by lane, and its derivative:
// x where x > 0 or NaN (derivative 1), else 0.1 expm1(10 x) (derivative
// exp(10 x)), with expm1 = (s - 1) + s q from exp_parts, accurate near 0.
// The 8- and 16-lane versions do the same operations: the same bits.
TF_AVX2_INLINE __m256 celu01(__m256 x, __m256& deriv) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 s, q;
  exp_parts(_mm256_mul_ps(x, _mm256_set1_ps(10.0f)), s, q);
  const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NLE_UQ);
  deriv = _mm256_blendv_ps(_mm256_fmadd_ps(s, q, s), one, pos);
  const __m256 em1 = _mm256_fmadd_ps(s, q, _mm256_sub_ps(s, one));
  return _mm256_blendv_ps(_mm256_mul_ps(_mm256_set1_ps(0.1f), em1), x, pos);
}

TF_AVX512_INLINE __m512 celu01(__m512 x, __m512& deriv) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 s, q;
  exp_parts(_mm512_mul_ps(x, _mm512_set1_ps(10.0f)), s, q);
  const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NLE_UQ);
  deriv = _mm512_mask_blend_ps(pos, _mm512_fmadd_ps(s, q, s), one);
  const __m512 em1 = _mm512_fmadd_ps(s, q, _mm512_sub_ps(s, one));
  return _mm512_mask_blend_ps(pos, _mm512_mul_ps(_mm512_set1_ps(0.1f), em1), x);
}

TF_AVX2_INLINE __m256 exp(__m256 u) {
  __m256 s, q;
  exp_parts(u, s, q);
  // NaN lanes stay NaN.
  return _mm256_blendv_ps(_mm256_fmadd_ps(s, q, s), u, _mm256_cmp_ps(u, u, _CMP_UNORD_Q));
}

// exp of N vectors (out may be u): the 8-lane exp's operations, lane by lane.
template <int N>
TF_AVX512_INLINE void exp_n(const __m512 (&u)[N], __m512 (&out)[N]) {
  __m512 s[N], q[N];
  exp_parts_n(u, s, q);
  for (int i = 0; i < N; ++i)
    out[i] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u[i], u[i], _CMP_UNORD_Q),
                                  _mm512_fmadd_ps(s[i], q[i], s[i]), u[i]);
}

// ln x for x > 0 (x = m 2^e, m in [sqrt(1/2), sqrt(2)), atanh series of m).
// x = 0 gives -88 (so exp(y log x) is 0 for y >= 1), not -inf.
TF_AVX2_INLINE __m256 log(__m256 x) {
  const __m256i xi = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(xi, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(exp_log::kSqrt2), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_sub_epi32(e, _mm256_castps_si256(big));  // a true lane is -1 as an integer
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
  const __m256 t2 = _mm256_mul_ps(t, t);
  const float* a = exp_log::kAtanh;
  __m256 p = _mm256_fmadd_ps(t2, _mm256_set1_ps(a[0]), _mm256_set1_ps(a[1]));
  for (int i = 2; i < 5; ++i) p = _mm256_fmadd_ps(t2, p, _mm256_set1_ps(a[i]));
  const __m256 twice_t = _mm256_add_ps(t, t);
  const __m256 ln_m = _mm256_fmadd_ps(_mm256_mul_ps(twice_t, t2), p, twice_t);
  const __m256 ef = _mm256_cvtepi32_ps(e);
  return _mm256_fmadd_ps(ef, _mm256_set1_ps(exp_log::kLn2Hi),
                         _mm256_fmadd_ps(ef, _mm256_set1_ps(exp_log::kLn2Lo), ln_m));
}

// log of N vectors (out may be x), step by step across them as exp_n: the
// same operations as the 8-lane log, lane by lane, so the same bits.
template <int N>
TF_AVX512_INLINE void log_n(const __m512 (&x)[N], __m512 (&out)[N]) {
  const __mmask16 all = 0xFFFF;
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 m[N], t[N], t2[N], p[N];
  __m512i e[N];
  for (int i = 0; i < N; ++i) {
    const __m512i xi = _mm512_castps_si512(x[i]);
    e[i] = _mm512_sub_epi32(_mm512_maskz_srli_epi32(all, xi, 23), _mm512_set1_epi32(127));
    m[i] = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_and_si512(xi, _mm512_set1_epi32(0x007fffff)), _mm512_set1_epi32(0x3f800000)));
    const __mmask16 big = _mm512_cmp_ps_mask(m[i], _mm512_set1_ps(exp_log::kSqrt2), _CMP_GT_OQ);
    m[i] = _mm512_mask_mul_ps(m[i], big, m[i], _mm512_set1_ps(0.5f));
    e[i] = _mm512_mask_add_epi32(e[i], big, e[i], _mm512_set1_epi32(1));
  }
  for (int i = 0; i < N; ++i) t[i] = _mm512_div_ps(_mm512_sub_ps(m[i], one), _mm512_add_ps(m[i], one));
  for (int i = 0; i < N; ++i) t2[i] = _mm512_mul_ps(t[i], t[i]);
  const float* a = exp_log::kAtanh;
  for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(t2[i], _mm512_set1_ps(a[0]), _mm512_set1_ps(a[1]));
  for (int j = 2; j < 5; ++j)
    for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(t2[i], p[i], _mm512_set1_ps(a[j]));
  for (int i = 0; i < N; ++i) {
    const __m512 twice_t = _mm512_add_ps(t[i], t[i]);
    const __m512 ln_m = _mm512_fmadd_ps(_mm512_mul_ps(twice_t, t2[i]), p[i], twice_t);
    const __m512 ef = _mm512_maskz_cvtepi32_ps(all, e[i]);
    out[i] = _mm512_fmadd_ps(ef, _mm512_set1_ps(exp_log::kLn2Hi),
                             _mm512_fmadd_ps(ef, _mm512_set1_ps(exp_log::kLn2Lo), ln_m));
  }
}

// sin(v) for |v| <= pi / 2: Taylor series to v^13 (truncation below 1e-9).
TF_AVX2_INLINE __m256 sin_half_pi(__m256 v) {
  const __m256 v2 = _mm256_mul_ps(v, v);
  __m256 p = _mm256_fmadd_ps(v2, _mm256_set1_ps(1.0f / 6227020800.0f), _mm256_set1_ps(-1.0f / 39916800.0f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(1.0f / 362880.0f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(-1.0f / 5040.0f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(v2, p, _mm256_set1_ps(-1.0f / 6.0f));
  return _mm256_fmadd_ps(_mm256_mul_ps(v, v2), p, v);
}

// cos(x) and sin(x) for 0 <= x <= pi (the cutoff function's range), through
// sin of pi/2 - x and of min(x, pi - x), each reduced with a two-part pi so
// that both keep their relative accuracy near their zeros.
TF_AVX2_INLINE void cos_sin_0_pi(__m256 x, __m256& c, __m256& s) {
  const __m256 half_pi = _mm256_sub_ps(_mm256_set1_ps(1.57079637f), x);
  c = sin_half_pi(_mm256_add_ps(half_pi, _mm256_set1_ps(-4.37113883e-8f)));
  const __m256 pi_minus = _mm256_add_ps(_mm256_sub_ps(_mm256_set1_ps(3.14159274f), x),
                                        _mm256_set1_ps(-8.74227766e-8f));
  s = sin_half_pi(_mm256_min_ps(x, pi_minus));
}

// erf and GELU (exact, erf form: torch.nn.GELU()'s default, TorchANI's "gelu").
// For a >= 0, erfc(a) = t exp(-a^2) Q(t), t = 1 / (1 + a / 2), Q a degree-10
// polynomial fitted (for this file) to erfc's relative error on [0, 10] (t in
// [1/6, 1]; 3.6e-9 in exact arithmetic, about 2.5 ulp in float32); exp(-a^2)
// is exp(-hi) (1 - lo) with a^2 = hi + lo (an FMA), so that the rounding of a^2
// does not reach erfc's tail. Near 0 both are odd polynomials, x (c0 + x^2 R(x^2))
// with c0 in two parts (fitted for relative error, 1.4e-9): erf(a) for a < 1,
// Phi(x) - 1/2 for |x| < sqrt 2. erf within 1.3 ulp of the C library's over all
// floats, GELU within a few ulp (tests/test_nn_gelu.py).
namespace erf_detail {
constexpr float kTail[11] = {0.03570684f,  -0.19066194f, 0.38040516f, -0.28797817f,
                             -0.023611901f, 0.03653856f, 0.054352954f, 0.18575658f,
                             0.24514769f,  0.2822559f,   0.28208837f};  // Q, from t^10 down
// erf(a) = a (c0 + s R(s)), s = a^2, a < 1; R from s^5 down, c0 = 2 / sqrt(pi) = hi + lo
constexpr float kErfR[6] = {7.8862955e-05f, -0.00080210186f, 0.0051897243f, -0.026854683f,
                            0.112836115f, -0.3761263f};
constexpr float kErfC0Hi = 1.1283792f, kErfC0Lo = -5.8635383e-08f;
// Phi(x) - 1/2 = x (h0 + u H(u)), u = x^2 < 2; H from u^5 down, h0 = 1 / sqrt(2 pi) = hi + lo
constexpr float kPhiR[6] = {4.3566038e-07f, -8.862057e-06f, 0.00011467779f, -0.0011868206f,
                            0.009973398f, -0.06649036f};
constexpr float kPhiH0Hi = 0.3989423f, kPhiH0Lo = -1.133517e-08f;
constexpr float kClamp = 20.0f;  // |x| of GELU above which Phi(x) is 0 or 1 in float32
constexpr float kSqrt2 = 1.41421356237309505f;
// The odd polynomial gives Phi for kCentreLow < x < sqrt 2: below, 1/2 + (a
// negative odd part) would lose Phi's relative accuracy (Phi < 1/4 there).
constexpr float kCentreLow = -0.67f;
constexpr float kHalfRsqrt2 = 0.35355339059327376f;  // t = 1 / (1 + |x| / (2 sqrt 2)) for GELU
constexpr float kRsqrt2Pi = 0.39894228040143268f;    // 1 / sqrt(2 pi)
}  // namespace erf_detail

// t Q(t) exp(-hi) (1 - lo): erfc of a >= 0 with t = 1 / (1 + a / 2) and a^2 = hi + lo;
// e receives exp(-hi) (1 - lo).
TF_AVX2_INLINE __m256 erfc_from(__m256 t, __m256 hi, __m256 lo, __m256& e) {
  using namespace erf_detail;
  __m256 q = _mm256_fmadd_ps(t, _mm256_set1_ps(kTail[0]), _mm256_set1_ps(kTail[1]));
  for (int i = 2; i < 11; ++i) q = _mm256_fmadd_ps(t, q, _mm256_set1_ps(kTail[i]));
  __m256 s, r;
  exp_parts(_mm256_sub_ps(_mm256_setzero_ps(), hi), s, r);
  e = _mm256_fmadd_ps(s, r, s);
  e = _mm256_fnmadd_ps(e, lo, e);
  return _mm256_mul_ps(_mm256_mul_ps(t, q), e);
}

// a (c_hi + c_lo + u R(u)), R of degree 5 (coefficients from u^5 down).
TF_AVX2_INLINE __m256 odd_poly(__m256 a, __m256 u, const float (&r)[6], float c_hi, float c_lo) {
  __m256 p = _mm256_fmadd_ps(u, _mm256_set1_ps(r[0]), _mm256_set1_ps(r[1]));
  for (int i = 2; i < 6; ++i) p = _mm256_fmadd_ps(u, p, _mm256_set1_ps(r[i]));
  return _mm256_fmadd_ps(a, _mm256_set1_ps(c_hi),
                         _mm256_mul_ps(a, _mm256_fmadd_ps(u, p, _mm256_set1_ps(c_lo))));
}

// erf(x), lane by lane (NaN stays NaN).
TF_AVX2_INLINE __m256 erf(__m256 x) {
  using namespace erf_detail;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(10.0f));
  const __m256 hi = _mm256_mul_ps(a, a), lo = _mm256_fmsub_ps(a, a, hi);
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                 _mm256_fmadd_ps(a, _mm256_set1_ps(0.5f), _mm256_set1_ps(1.0f)));
  __m256 e;
  const __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f), erfc_from(t, hi, lo, e));
  const __m256 small = odd_poly(a, hi, kErfR, kErfC0Hi, kErfC0Lo);
  const __m256 mag = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(1.0f), _CMP_LT_OQ));
  const __m256 out = _mm256_or_ps(mag, _mm256_and_ps(x, sign));
  return _mm256_blendv_ps(out, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// GELU(x) = x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2, lane by lane, and its
// derivative Phi(x) + x exp(-x^2 / 2) / sqrt(2 pi). Phi is 1/2 + the odd
// polynomial for -0.67 < x < sqrt 2, else erfc(|x| / sqrt 2) / 2 below 0 (its
// relative accuracy kept in the left tail) and 1 - that above; |x| is clamped
// to 20 inside (Phi exactly 0 or 1 there) and x itself multiplies, so NaN
// stays NaN.
TF_AVX2_INLINE __m256 gelu(__m256 x, __m256& deriv) {
  using namespace erf_detail;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(kClamp));
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 sq = _mm256_mul_ps(a, a);
  const __m256 hi = _mm256_mul_ps(sq, half), lo = _mm256_mul_ps(_mm256_fmsub_ps(a, a, sq), half);
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                 _mm256_fmadd_ps(a, _mm256_set1_ps(kHalfRsqrt2), _mm256_set1_ps(1.0f)));
  __m256 e;
  const __m256 half_erfc = _mm256_mul_ps(erfc_from(t, hi, lo, e), half);
  const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 tail = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), half_erfc), half_erfc, neg);
  const __m256 centre = _mm256_add_ps(
      half, _mm256_xor_ps(odd_poly(a, sq, kPhiR, kPhiH0Hi, kPhiH0Lo), _mm256_and_ps(x, sign)));
  const __m256 in_centre = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(kSqrt2), _CMP_LT_OQ),
                                         _mm256_cmp_ps(x, _mm256_set1_ps(kCentreLow), _CMP_GT_OQ));
  const __m256 phi = _mm256_blendv_ps(tail, centre, in_centre);
  deriv = _mm256_fmadd_ps(_mm256_mul_ps(x, e), _mm256_set1_ps(kRsqrt2Pi), phi);
  return _mm256_mul_ps(x, phi);
}

// The same on 16 lanes: the same operations, so the same bits. (The masked
// min with every lane set is the unmasked one without GCC 12's warning, see
// exp_parts_n.)
TF_AVX512_INLINE __m512 erfc_from(__m512 t, __m512 hi, __m512 lo, __m512& e) {
  using namespace erf_detail;
  __m512 q = _mm512_fmadd_ps(t, _mm512_set1_ps(kTail[0]), _mm512_set1_ps(kTail[1]));
  for (int i = 2; i < 11; ++i) q = _mm512_fmadd_ps(t, q, _mm512_set1_ps(kTail[i]));
  __m512 s, r;
  exp_parts(_mm512_sub_ps(_mm512_setzero_ps(), hi), s, r);
  e = _mm512_fmadd_ps(s, r, s);
  e = _mm512_fnmadd_ps(e, lo, e);
  return _mm512_mul_ps(_mm512_mul_ps(t, q), e);
}

TF_AVX512_INLINE __m512 odd_poly(__m512 a, __m512 u, const float (&r)[6], float c_hi, float c_lo) {
  __m512 p = _mm512_fmadd_ps(u, _mm512_set1_ps(r[0]), _mm512_set1_ps(r[1]));
  for (int i = 2; i < 6; ++i) p = _mm512_fmadd_ps(u, p, _mm512_set1_ps(r[i]));
  return _mm512_fmadd_ps(a, _mm512_set1_ps(c_hi),
                         _mm512_mul_ps(a, _mm512_fmadd_ps(u, p, _mm512_set1_ps(c_lo))));
}

TF_AVX512_INLINE __m512 abs_min(__m512 x, float bound) {
  const __m512 a = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
  return _mm512_mask_min_ps(a, 0xFFFF, a, _mm512_set1_ps(bound));
}

TF_AVX512_INLINE __m512 sign_of(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u))));
}

TF_AVX512_INLINE __m512 erf(__m512 x) {
  using namespace erf_detail;
  const __m512 a = abs_min(x, 10.0f);
  const __m512 hi = _mm512_mul_ps(a, a), lo = _mm512_fmsub_ps(a, a, hi);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                 _mm512_fmadd_ps(a, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)));
  __m512 e;
  const __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f), erfc_from(t, hi, lo, e));
  const __m512 small = odd_poly(a, hi, kErfR, kErfC0Hi, kErfC0Lo);
  const __m512 mag =
      _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LT_OQ), big, small);
  const __m512 out = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(mag), _mm512_castps_si512(sign_of(x))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), out, x);
}

TF_AVX512_INLINE __m512 gelu(__m512 x, __m512& deriv) {
  using namespace erf_detail;
  const __m512 a = abs_min(x, kClamp);
  const __m512 half = _mm512_set1_ps(0.5f);
  const __m512 sq = _mm512_mul_ps(a, a);
  const __m512 hi = _mm512_mul_ps(sq, half), lo = _mm512_mul_ps(_mm512_fmsub_ps(a, a, sq), half);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                 _mm512_fmadd_ps(a, _mm512_set1_ps(kHalfRsqrt2), _mm512_set1_ps(1.0f)));
  __m512 e;
  const __m512 half_erfc = _mm512_mul_ps(erfc_from(t, hi, lo, e), half);
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 tail =
      _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(1.0f), half_erfc), half_erfc);
  const __m512 odd = odd_poly(a, sq, kPhiR, kPhiH0Hi, kPhiH0Lo);
  const __m512 centre = _mm512_add_ps(half, _mm512_castsi512_ps(_mm512_xor_si512(
                                                _mm512_castps_si512(odd), _mm512_castps_si512(sign_of(x)))));
  const __mmask16 in_centre = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kSqrt2), _CMP_LT_OQ) &
                              _mm512_cmp_ps_mask(x, _mm512_set1_ps(kCentreLow), _CMP_GT_OQ);
  const __m512 phi = _mm512_mask_blend_ps(in_centre, tail, centre);
  deriv = _mm512_fmadd_ps(_mm512_mul_ps(x, e), _mm512_set1_ps(kRsqrt2Pi), phi);
  return _mm512_mul_ps(x, phi);
}

TF_AVX2_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The four horizontal sums of a, b, c, d.
TF_AVX2_INLINE __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

}  // namespace torchani_fast::simd
#endif
