// CPU second derivatives of the AEV: the two halves of aev_backward's backward,
// and the per-atom derivatives from which whole Hessians are assembled.
//
// The math (per pair and per centre atom) is in aev/second_derivs.h, shared
// with the CUDA kernels (aev/cuda/second_cuda.cu); this file builds the CPU
// half-edge layout (aev/half_edges.h), runs the per-centre functions over the
// atoms with at::parallel_for and gathers the results.
//
// Same layout as aev/aev_cpu.cpp: pairs become half edges owned by one atom, each
// atom's AEV row depends only on its own half edges, so the loop over centre
// atoms writes disjoint outputs (no atomics, same bits for any thread count).
// Triples and radial terms whose half edges all have a zero direction
// contribute exactly zero and are skipped: a Hessian column (one coordinate
// moved) then costs the neighbourhood of that atom, not the whole system.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "aev/half_edges.h"
#include "common/parallel.h"
#include "common/simd_math.h"

namespace torchani_fast {

using namespace aev_cpu_detail;

namespace {

// Pair directions (P, 3) -> half-edge directions in each owner's frame.
template <typename scalar_t>
void edge_directions(const HalfEdges& h, const scalar_t* t, int64_t num_pairs,
                     std::vector<scalar_t>& u, std::vector<uint8_t>& moving) {
  const int64_t E = h.edges();
  u.assign(3 * E, scalar_t(0));
  moving.assign(E, 0);
  torchani_fast::parallel_for(0, num_pairs, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      if (h.edge0[q] >= 0)
        aev_math::edge_direction(h.edge0[q], h.edge1[q], t + 3 * q, u.data(), moving.data());
  });
}

#ifdef TF_SIMD_AVX2
// float32 on AVX2: jvp_center and hvp_center 8 at a time, with the exps and
// logs of simd:: (within 2 ulp, as the vectorised AEV's; the scalar path calls
// libm). The radial terms of one neighbour 8 shifts at a time (a Terms policy
// of aev_math::jvp_radial_center / hvp_radial_center); the angular terms 8
// triples at a time, their inputs packed lane by lane (TripleLanes), their
// results added to the centre's row or half edges triple by triple in the
// scalar code's order. The formulas are aev_math's (angle_terms,
// distance_terms, psi_contract, triple_grad, triple_hvp, jvp_triple), the
// divisions by r as products with 1 / r; a clamped triple (r1 r2 < 1e-10)
// takes the scalar functions. The per-centre work does not depend on the
// thread, so the results are the same for any thread count.
using aev_math::ConstView;
using aev_math::Triple;

// float32 scratch of one thread's centres.
struct TermScratch {
  std::vector<Neighbor<float>> neighbors;
  std::vector<float> block;  // jvp_lanes8's A Z rows of 8 lanes
};

// For the radial shifts s .. s + 8 at distance r (rr): their eta, x = r - Rs
// and 0.25 exp(-eta x^2).
TF_AVX2_INLINE __m256 radial_gauss8(const ConstView<float>& k, __m256 rr, int64_t s, __m256& eta,
                                    __m256& x) {
  eta = _mm256_loadu_ps(k.eta_r + s);
  x = _mm256_sub_ps(rr, _mm256_loadu_ps(k.shf_r + s));
  const __m256 u = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), eta), x), x);
  return _mm256_mul_ps(_mm256_set1_ps(0.25f), simd::exp(u));
}

// o[s] += dr d rad_s / dr (aev_math::radial_jvp).
TF_AVX2 void radial_jvp8(const ConstView<float>& k, float r, float fc, float dfc, float dr,
                         float* o) {
  const __m256 rr = _mm256_set1_ps(r), vfc = _mm256_set1_ps(fc), vdfc = _mm256_set1_ps(dfc);
  const __m256 vdr = _mm256_set1_ps(dr);
  int64_t s = 0;
  for (; s + 8 <= k.R; s += 8) {
    __m256 eta, x;
    const __m256 ex = radial_gauss8(k, rr, s, eta, x);
    const __m256 slope = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_add_ps(eta, eta), x), vfc, vdfc);
    _mm256_storeu_ps(o + s, _mm256_fmadd_ps(_mm256_mul_ps(vdr, ex), slope, _mm256_loadu_ps(o + s)));
  }
  for (; s < k.R; ++s) {
    const float x = r - k.shf_r[s];
    o[s] += dr * (0.25f * std::exp(-k.eta_r[s] * x * x)) * (dfc - 2.0f * k.eta_r[s] * x * fc);
  }
}

// The horizontal sum of v.
TF_AVX2_INLINE float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// aev_math::radial_phi.
TF_AVX2 void radial_phi8(const ConstView<float>& k, float r, const float* g, float& phi1,
                         float& phi2) {
  const float fc = aev_math::cutoff_value(k.cut, r, k.rc_r);
  const float dfc = aev_math::cutoff_deriv(k.cut, r, k.rc_r);
  const float d2fc = aev_math::cutoff_deriv2(k.cut, r, k.rc_r);
  const __m256 rr = _mm256_set1_ps(r), vfc = _mm256_set1_ps(fc), vdfc = _mm256_set1_ps(dfc);
  const __m256 vd2fc = _mm256_set1_ps(d2fc);
  __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= k.R; s += 8) {
    __m256 eta, x;
    const __m256 e = radial_gauss8(k, rr, s, eta, x);
    const __m256 two_eta_x = _mm256_mul_ps(_mm256_add_ps(eta, eta), x);
    const __m256 de = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(two_eta_x, e));
    // d2e = (4 eta^2 x^2 - 2 eta) e
    const __m256 d2e = _mm256_mul_ps(
        _mm256_fmsub_ps(two_eta_x, two_eta_x, _mm256_add_ps(eta, eta)), e);
    const __m256 gs = _mm256_loadu_ps(g + s);
    acc1 = _mm256_fmadd_ps(gs, _mm256_fmadd_ps(de, vfc, _mm256_mul_ps(e, vdfc)), acc1);
    const __m256 two_de_dfc = _mm256_mul_ps(_mm256_add_ps(de, de), vdfc);
    acc2 = _mm256_fmadd_ps(
        gs, _mm256_fmadd_ps(d2e, vfc, _mm256_fmadd_ps(e, vd2fc, two_de_dfc)), acc2);
  }
  phi1 = hsum(acc1);
  phi2 = hsum(acc2);
  for (; s < k.R; ++s) {
    const float eta = k.eta_r[s], x = r - k.shf_r[s];
    const float e = 0.25f * std::exp(-eta * x * x), de = -2.0f * eta * x * e;
    const float d2e = (4.0f * eta * eta * x * x - 2.0f * eta) * e;
    phi1 += g[s] * (de * fc + e * dfc);
    phi2 += g[s] * (d2e * fc + 2.0f * de * dfc + e * d2fc);
  }
}

// The parts of 8 triples that every section's terms use.
struct TripleLanes8 {
  __m256 c, s, c_over_s, inv_s3;
};
TF_AVX2_INLINE TripleLanes8 triple_lanes8(__m256 c, __m256 s) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return {c, s, _mm256_div_ps(c, s), _mm256_div_ps(one, _mm256_mul_ps(_mm256_mul_ps(s, s), s))};
}

// aev_math::angle_terms of section z for 8 triples: f1, df1 and (second) d2f1.
TF_AVX2_INLINE void section_terms8(const ConstView<float>& k, int64_t z, const TripleLanes8& t,
                                   bool second, __m256& f1, __m256& df1, __m256& d2f1) {
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
  const float zeta = k.zeta[z];
  const __m256 cos_z = _mm256_set1_ps(k.cos_z[z]), sin_z = _mm256_set1_ps(k.sin_z[z]);
  const __m256 cdev = _mm256_fmadd_ps(t.c, cos_z, _mm256_mul_ps(t.s, sin_z));
  const __m256 base = _mm256_mul_ps(_mm256_add_ps(one, cdev), half);
  const __m256 ln = simd::log(base);
  const __m256 d1 = _mm256_fnmadd_ps(t.c_over_s, sin_z, cos_z);
  const bool from_pw2 = second && zeta >= 2.0f;
  const __m256 pw2 = second ? simd::exp(_mm256_mul_ps(_mm256_set1_ps(zeta - 2.0f), ln))
                            : _mm256_setzero_ps();
  const __m256 pw1 = from_pw2 ? _mm256_mul_ps(pw2, base)
                              : simd::exp(_mm256_mul_ps(_mm256_set1_ps(zeta - 1.0f), ln));
  const __m256 zeta_pw1 = _mm256_mul_ps(_mm256_set1_ps(zeta), pw1);
  f1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(2.0f), pw1), base);
  df1 = _mm256_mul_ps(zeta_pw1, d1);
  if (second) {
    const __m256 d2 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(sin_z, t.inv_s3));
    const __m256 curv = _mm256_mul_ps(_mm256_set1_ps(zeta * (zeta - 1.0f) / 2.0f),
                                      _mm256_mul_ps(_mm256_mul_ps(pw2, d1), d1));
    d2f1 = _mm256_fmadd_ps(zeta_pw1, d2, curv);
  }
}

// aev_math::distance_terms of shift a for 8 mean distances m: f2, df2 and (second) d2f2.
TF_AVX2_INLINE void shift_terms8(const ConstView<float>& k, int64_t a, __m256 m, bool second,
                                 __m256& f2, __m256& df2, __m256& d2f2) {
  const __m256 eta = _mm256_set1_ps(k.eta_a[a]);
  const __m256 x = _mm256_sub_ps(m, _mm256_set1_ps(k.shf_a[a]));
  f2 = simd::exp(_mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), eta), x), x));
  const __m256 two_eta_x = _mm256_mul_ps(_mm256_add_ps(eta, eta), x);
  df2 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(two_eta_x, f2));
  if (second)
    d2f2 = _mm256_mul_ps(_mm256_fmsub_ps(two_eta_x, two_eta_x, _mm256_add_ps(eta, eta)), f2);
}

// The most angular shifts (A) and sections (Z) of the 8-lane angular kernels.
constexpr int64_t kMaxAngular8 = 16;

// The inputs of 8 triples of jvp_lanes8 and hvp_lanes8, one row of 8 lanes per
// field (the half edges' vectors, tangents, 1 / r and angular cutoffs, the
// triple's c, sin_c, mean distance and cos).
enum TripleField {
  kX1, kY1, kZ1, kX2, kY2, kZ2, kU1x, kU1y, kU1z, kU2x, kU2y, kU2z,
  kInv1, kInv2, kFc1, kFc2, kDfc1, kDfc2, kD2fc1, kD2fc2, kC, kS, kM, kQ, kTripleFields
};

TF_AVX2_INLINE __m256 dot3_8(const __m256 (&x)[3], const __m256 (&y)[3]) {
  return _mm256_fmadd_ps(x[2], y[2], _mm256_fmadd_ps(x[1], y[1], _mm256_mul_ps(x[0], y[0])));
}

// The geometry of 8 triples: h = v / r, gq = dq/dv (not clamped), u.
struct Geometry8 {
  __m256 h1[3], h2[3], gq1[3], gq2[3], u1[3], u2[3];
};
TF_AVX2_INLINE Geometry8 geometry8(const float (&in)[kTripleFields][8]) {
  Geometry8 g;
  const __m256 inv1 = _mm256_load_ps(in[kInv1]), inv2 = _mm256_load_ps(in[kInv2]);
  const __m256 q = _mm256_load_ps(in[kQ]);
  for (int c = 0; c < 3; ++c) {
    g.h1[c] = _mm256_mul_ps(_mm256_load_ps(in[kX1 + c]), inv1);
    g.h2[c] = _mm256_mul_ps(_mm256_load_ps(in[kX2 + c]), inv2);
    g.u1[c] = _mm256_load_ps(in[kU1x + c]);
    g.u2[c] = _mm256_load_ps(in[kU2x + c]);
  }
  for (int c = 0; c < 3; ++c) {
    g.gq1[c] = _mm256_mul_ps(_mm256_fnmadd_ps(q, g.h1[c], g.h2[c]), inv1);
    g.gq2[c] = _mm256_mul_ps(_mm256_fnmadd_ps(q, g.h2[c], g.h1[c]), inv2);
  }
  return g;
}

// aev_math::jvp_triple of 8 triples: out[8 (a Z + z) + lane], the directional
// derivative of each triple's angular block along its u.
TF_AVX2 void jvp_lanes8(const ConstView<float>& k, const float (&in)[kTripleFields][8],
                        float* out) {
  const int64_t Z = k.Z, A = k.A;
  const Geometry8 g = geometry8(in);
  const __m256 dq = _mm256_add_ps(dot3_8(g.gq1, g.u1), dot3_8(g.gq2, g.u2));
  const __m256 dr1 = dot3_8(g.h1, g.u1), dr2 = dot3_8(g.h2, g.u2);
  const __m256 fc1 = _mm256_load_ps(in[kFc1]), fc2 = _mm256_load_ps(in[kFc2]);
  const __m256 fcc = _mm256_mul_ps(fc1, fc2);
  const __m256 dfc1 = _mm256_load_ps(in[kDfc1]), dfc2 = _mm256_load_ps(in[kDfc2]);
  const __m256 dfcc = _mm256_fmadd_ps(_mm256_mul_ps(fc1, dfc2), dr2,
                                      _mm256_mul_ps(_mm256_mul_ps(dfc1, fc2), dr1));
  const __m256 cq = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.95f), dq), fcc);
  const __m256 cm =
      _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_add_ps(dr1, dr2)), fcc);
  const TripleLanes8 t = triple_lanes8(_mm256_load_ps(in[kC]), _mm256_load_ps(in[kS]));
  __m256 f1[kMaxAngular8], df1[kMaxAngular8], unused;
  for (int64_t z = 0; z < Z; ++z) section_terms8(k, z, t, /*second=*/false, f1[z], df1[z], unused);
  const __m256 m = _mm256_load_ps(in[kM]);
  for (int64_t a = 0; a < A; ++a) {
    __m256 f2, df2;
    shift_terms8(k, a, m, /*second=*/false, f2, df2, unused);
    const __m256 pa = _mm256_mul_ps(cq, f2);
    const __m256 qa = _mm256_fmadd_ps(dfcc, f2, _mm256_mul_ps(cm, df2));
    for (int64_t z = 0; z < Z; ++z)
      _mm256_storeu_ps(out + 8 * (a * Z + z),
                       _mm256_fmadd_ps(qa, f1[z], _mm256_mul_ps(pa, df1[z])));
  }
}

// The angular Hessian-vector product of 8 triples (hvp_angular8's lanes):
// out[0..3) the gradient of the first half edge of each, out[3..6) the second's.
TF_AVX2 void hvp_lanes8(const ConstView<float>& k, const float* grow,
                        const float (&in)[kTripleFields][8], const int32_t (&goff)[8],
                        float (&out)[6][8]) {
  const int64_t Z = k.Z, A = k.A;
  const TripleLanes8 t = triple_lanes8(_mm256_load_ps(in[kC]), _mm256_load_ps(in[kS]));
  // The distance terms of every shift, then per section its terms and the
  // contractions over the shifts (t0, t1, t2: with f2, df2, d2f2).
  __m256 f2[kMaxAngular8], df2[kMaxAngular8], d2f2[kMaxAngular8];
  const __m256 m = _mm256_load_ps(in[kM]);
  for (int64_t a = 0; a < A; ++a) shift_terms8(k, a, m, /*second=*/true, f2[a], df2[a], d2f2[a]);
  const __m256i offsets = _mm256_load_si256(reinterpret_cast<const __m256i*>(goff));
  __m256 s00 = _mm256_setzero_ps(), s01 = s00, s02 = s00, s10 = s00, s11 = s00, s20 = s00;
  for (int64_t z = 0; z < Z; ++z) {
    __m256 f1, df1, d2f1;
    section_terms8(k, z, t, /*second=*/true, f1, df1, d2f1);
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0;
    for (int64_t a = 0; a < A; ++a) {
      const __m256 g = _mm256_i32gather_ps(
          grow, _mm256_add_epi32(offsets, _mm256_set1_epi32(static_cast<int32_t>(a * Z + z))), 4);
      t0 = _mm256_fmadd_ps(g, f2[a], t0);
      t1 = _mm256_fmadd_ps(g, df2[a], t1);
      t2 = _mm256_fmadd_ps(g, d2f2[a], t2);
    }
    s00 = _mm256_fmadd_ps(f1, t0, s00);
    s01 = _mm256_fmadd_ps(f1, t1, s01);
    s02 = _mm256_fmadd_ps(f1, t2, s02);
    s10 = _mm256_fmadd_ps(df1, t0, s10);
    s11 = _mm256_fmadd_ps(df1, t1, s11);
    s20 = _mm256_fmadd_ps(d2f1, t0, s20);
  }
  // aev_math::psi_contract's chain rule.
  const __m256 fc1 = _mm256_load_ps(in[kFc1]), fc2 = _mm256_load_ps(in[kFc2]);
  const __m256 dfc1 = _mm256_load_ps(in[kDfc1]), dfc2 = _mm256_load_ps(in[kDfc2]);
  const __m256 C = _mm256_mul_ps(fc1, fc2), k95 = _mm256_set1_ps(0.95f);
  const __m256 half = _mm256_set1_ps(0.5f), quarter = _mm256_set1_ps(0.25f);
  const __m256 d1c = _mm256_mul_ps(dfc1, fc2), d2c = _mm256_mul_ps(fc1, dfc2);
  const __m256 half_C_s01 = _mm256_mul_ps(_mm256_mul_ps(half, C), s01);
  const __m256 half_C_s11 = _mm256_mul_ps(_mm256_mul_ps(half, C), s11);
  const __m256 quarter_C_s02 = _mm256_mul_ps(_mm256_mul_ps(quarter, C), s02);
  const __m256 p_q = _mm256_mul_ps(_mm256_mul_ps(k95, C), s10);
  const __m256 p_r1 = _mm256_fmadd_ps(d1c, s00, half_C_s01);
  const __m256 p_r2 = _mm256_fmadd_ps(d2c, s00, half_C_s01);
  const __m256 p_qq = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(k95, k95), C), s20);
  const __m256 p_q1 = _mm256_mul_ps(k95, _mm256_fmadd_ps(d1c, s10, half_C_s11));
  const __m256 p_q2 = _mm256_mul_ps(k95, _mm256_fmadd_ps(d2c, s10, half_C_s11));
  const __m256 p_r11 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(in[kD2fc1]), fc2), s00,
                                       _mm256_fmadd_ps(d1c, s01, quarter_C_s02));
  const __m256 p_r22 = _mm256_fmadd_ps(_mm256_mul_ps(fc1, _mm256_load_ps(in[kD2fc2])), s00,
                                       _mm256_fmadd_ps(d2c, s01, quarter_C_s02));
  const __m256 p_r12 = _mm256_fmadd_ps(_mm256_mul_ps(dfc1, dfc2), s00,
                                       _mm256_fmadd_ps(_mm256_mul_ps(half, _mm256_add_ps(d1c, d2c)),
                                                       s01, quarter_C_s02));
  // aev_math::triple_grad and triple_hvp (not clamped).
  const Geometry8 geo = geometry8(in);
  const __m256 inv1 = _mm256_load_ps(in[kInv1]), inv2 = _mm256_load_ps(in[kInv2]);
  const __m256 q = _mm256_load_ps(in[kQ]);
  const auto &h1 = geo.h1, &h2 = geo.h2, &gq1 = geo.gq1, &gq2 = geo.gq2, &u1 = geo.u1, &u2 = geo.u2;
  const __m256 dq = _mm256_add_ps(dot3_8(gq1, u1), dot3_8(gq2, u2));
  const __m256 a1 = dot3_8(h1, u1), b1 = dot3_8(h2, u1), a2 = dot3_8(h1, u2), b2 = dot3_8(h2, u2);
  const __m256 c_q = _mm256_fmadd_ps(p_q2, b2, _mm256_fmadd_ps(p_q1, a1, _mm256_mul_ps(p_qq, dq)));
  const __m256 c_1 =
      _mm256_fmadd_ps(p_r12, b2, _mm256_fmadd_ps(p_r11, a1, _mm256_mul_ps(p_q1, dq)));
  const __m256 c_2 =
      _mm256_fmadd_ps(p_r22, b2, _mm256_fmadd_ps(p_r12, a1, _mm256_mul_ps(p_q2, dq)));
  const __m256 i11 = _mm256_mul_ps(inv1, inv1), i22 = _mm256_mul_ps(inv2, inv2);
  const __m256 i12 = _mm256_mul_ps(inv1, inv2), three_q = _mm256_mul_ps(_mm256_set1_ps(3.0f), q);
  const __m256 qa1 = _mm256_mul_ps(q, a1), qb2 = _mm256_mul_ps(q, b2);
  const __m256 qa1_3 = _mm256_mul_ps(three_q, a1), qb2_3 = _mm256_mul_ps(three_q, b2);
  for (int c = 0; c < 3; ++c) {
    const __m256 x1 = h1[c], x2 = h2[c];
    // hq1 = (-a1 x2 - b1 x1 + 3 q a1 x1 - q u1) i11 + (u2 - b2 x2 - a2 x1 + q b2 x1) i12
    const __m256 p11 = _mm256_fnmadd_ps(
        q, u1[c], _mm256_fmsub_ps(qa1_3, x1, _mm256_fmadd_ps(a1, x2, _mm256_mul_ps(b1, x1))));
    const __m256 p12 = _mm256_fmadd_ps(
        qb2, x1, _mm256_sub_ps(u2[c], _mm256_fmadd_ps(b2, x2, _mm256_mul_ps(a2, x1))));
    const __m256 hq1 = _mm256_fmadd_ps(p11, i11, _mm256_mul_ps(p12, i12));
    // hq2 = (u1 - b1 x2 - a1 x1 + q a1 x2) i12 + (-b2 x1 - a2 x2 + 3 q b2 x2 - q u2) i22
    const __m256 p21 = _mm256_fmadd_ps(
        qa1, x2, _mm256_sub_ps(u1[c], _mm256_fmadd_ps(b1, x2, _mm256_mul_ps(a1, x1))));
    const __m256 p22 = _mm256_fnmadd_ps(
        q, u2[c], _mm256_fmsub_ps(qb2_3, x2, _mm256_fmadd_ps(b2, x1, _mm256_mul_ps(a2, x2))));
    const __m256 hq2 = _mm256_fmadd_ps(p21, i12, _mm256_mul_ps(p22, i22));
    const __m256 hr1 = _mm256_mul_ps(_mm256_fnmadd_ps(a1, x1, u1[c]), inv1);
    const __m256 hr2 = _mm256_mul_ps(_mm256_fnmadd_ps(b2, x2, u2[c]), inv2);
    const __m256 o1 = _mm256_fmadd_ps(p_r1, hr1, _mm256_fmadd_ps(p_q, hq1, _mm256_fmadd_ps(
                                                         c_1, x1, _mm256_mul_ps(c_q, gq1[c]))));
    const __m256 o2 = _mm256_fmadd_ps(p_r2, hr2, _mm256_fmadd_ps(p_q, hq2, _mm256_fmadd_ps(
                                                         c_2, x2, _mm256_mul_ps(c_q, gq2[c]))));
    _mm256_store_ps(out[c], o1);
    _mm256_store_ps(out[3 + c], o2);
  }
}

// The inputs of up to 8 triples of one centre, one row of 8 lanes per field;
// n of them used.
struct TripleLanes {
  alignas(32) float in[kTripleFields][8];
  alignas(32) int32_t goff[8];  // the triple's angular block in the AEV row
  int64_t first[8], second[8];  // its neighbours in TermScratch::neighbors
  bool clamped[8];              // r1 r2 < 1e-10: the scalar functions' triple
  int64_t n = 0;

  // The unused lanes made benign (unit vectors, no cutoff), for run(lanes).
  void pad() {
    for (int64_t j = n; j < 8; ++j) {
      for (int f = 0; f < kTripleFields; ++f) in[f][j] = 0.0f;
      in[kX1][j] = in[kY2][j] = in[kInv1][j] = in[kInv2][j] = in[kS][j] = 1.0f;
      goff[j] = goff[0];
    }
  }
};

// For the triples of centre i that jvp_center and hvp_center visit, in their
// order, 8 at a time: run(lanes) on their packed inputs (with the angular
// cutoffs in fcw, aev_math::angular_cutoffs). sc.neighbors: the centre's.
template <typename Run>
void for_triples8(const ConstView<float>& k, const HalfEdgeView<float>& h, int64_t i,
                  const float* u_edge, const uint8_t* moving, bool second, float* fcw,
                  TermScratch& sc, const Run& run) {
  const int64_t begin = h.begin(i), count = h.end(i) - begin;
  aev_math::angular_cutoffs(k, h, i, second, fcw);
  sc.neighbors.resize(count);
  for (int64_t e = 0; e < count; ++e) sc.neighbors[e] = h.neighbor(begin + e);
  TripleLanes lanes;
  for (int64_t j1 = 0; j1 < count; ++j1) {
    const Neighbor<float>& n1 = sc.neighbors[j1];
    if (!(n1.r <= k.rc_a)) continue;
    for (int64_t j2 = j1 + 1; j2 < count; ++j2) {
      const Neighbor<float>& n2 = sc.neighbors[j2];
      if (!aev_math::visits_triple(k, n1.r, n2.r, moving, n1.edge, n2.edge)) continue;
      const Triple<float> t = make_triple(n1, n2);
      const int64_t e1 = n1.edge, e2 = n2.edge;
      const float* u1 = u_edge + 3 * e1;
      const float* u2 = u_edge + 3 * e2;
      const float vals[kTripleFields] = {
          n1.v[0], n1.v[1], n1.v[2], n2.v[0], n2.v[1], n2.v[2], u1[0], u1[1], u1[2],
          u2[0], u2[1], u2[2], n1.r > 0 ? 1.0f / n1.r : 0.0f, n2.r > 0 ? 1.0f / n2.r : 0.0f,
          fcw[3 * e1], fcw[3 * e2], fcw[3 * e1 + 1], fcw[3 * e2 + 1],
          second ? fcw[3 * e1 + 2] : 0.0f, second ? fcw[3 * e2 + 2] : 0.0f,
          t.clamped ? 0.0f : t.c, t.clamped ? 1.0f : t.sin_c, t.mean_r,
          t.clamped ? 0.0f : t.cos_raw};
      const int64_t n = lanes.n;
      for (int f = 0; f < kTripleFields; ++f) lanes.in[f][n] = vals[f];
      lanes.goff[n] =
          static_cast<int32_t>(k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z);
      lanes.first[n] = j1;
      lanes.second[n] = j2;
      lanes.clamped[n] = t.clamped;
      if (++lanes.n == 8) {
        run(lanes);
        lanes.n = 0;
      }
    }
  }
  if (lanes.n > 0) {
    lanes.pad();
    run(lanes);
  }
}

// aev_math::hvp_angular_center on 8 lanes (w: angular_scratch_len floats).
void hvp_angular8(const ConstView<float>& k, const HalfEdgeView<float>& h, int64_t i,
                  const float* grow, const float* u_edge, const uint8_t* moving, float* w,
                  float* fcw, float* out_edge, TermScratch& sc) {
  alignas(32) float out[6][8];
  for_triples8(k, h, i, u_edge, moving, /*second=*/true, fcw, sc, [&](const TripleLanes& l) {
    hvp_lanes8(k, grow, l.in, l.goff, out);
    for (int64_t j = 0; j < l.n; ++j) {
      const Neighbor<float>& n1 = sc.neighbors[l.first[j]];
      const Neighbor<float>& n2 = sc.neighbors[l.second[j]];
      if (l.clamped[j]) {
        const Triple<float> t = make_triple(n1, n2);
        aev_math::angular_terms(k, t, /*second=*/true, w);
        aev_math::hvp_triple(n1, n2, t, aev_math::triple_psi(k, n1, n2, grow, fcw, w), u_edge,
                             out_edge);
        continue;
      }
      float* o1 = out_edge + 3 * n1.edge;
      float* o2 = out_edge + 3 * n2.edge;
      for (int c = 0; c < 3; ++c) {
        o1[c] += out[c][j];
        o2[c] += out[3 + c][j];
      }
    }
  });
}

// aev_math::jvp_angular_center on 8 lanes (w: angular_scratch_len floats;
// out: A Z rows of 8 lanes).
void jvp_angular8(const ConstView<float>& k, const HalfEdgeView<float>& h, int64_t i,
                  const float* u_edge, const uint8_t* moving, float* w, float* fcw, float* row,
                  TermScratch& sc) {
  const int64_t block = k.A * k.Z;
  sc.block.resize(8 * block);
  float* out = sc.block.data();
  for_triples8(k, h, i, u_edge, moving, /*second=*/false, fcw, sc, [&](const TripleLanes& l) {
    jvp_lanes8(k, l.in, out);
    for (int64_t j = 0; j < l.n; ++j) {
      if (l.clamped[j]) {
        const Neighbor<float>& n1 = sc.neighbors[l.first[j]];
        const Neighbor<float>& n2 = sc.neighbors[l.second[j]];
        const Triple<float> t = make_triple(n1, n2);
        aev_math::angular_terms(k, t, /*second=*/false, w);
        aev_math::jvp_triple(k, n1, n2, t, u_edge, fcw, w, row);
        continue;
      }
      float* o = row + l.goff[j];
      for (int64_t q = 0; q < block; ++q) o[q] += out[8 * q + j];
    }
  });
}

// The aev_math Terms policy of the float32 AVX2 path (radial terms).
struct VectorTerms {
  TermScratch* w;

  void radial_jvp(const ConstView<float>& k, float r, float fc, float dfc, float dr,
                  float* o) const {
    radial_jvp8(k, r, fc, dfc, dr, o);
  }
  void radial_phi(const ConstView<float>& k, float r, const float* g, float& phi1,
                  float& phi2) const {
    radial_phi8(k, r, g, phi1, phi2);
  }
};
#endif

// fn(i, terms, w) for each centre i in [0, N) in parallel, with the fastest
// Terms policy for scalar_t and w: angular_scratch_len scalars of the thread.
template <typename scalar_t, typename Fn>
void for_each_centre(int64_t N, const aev_math::ConstView<scalar_t>& k, const Fn& fn) {
  torchani_fast::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
    std::vector<scalar_t> w(aev_math::angular_scratch_len(k));
#ifdef TF_SIMD_AVX2
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (simd::have_avx2() && k.A <= kMaxAngular8 && k.Z <= kMaxAngular8) {
        TermScratch scratch;
        for (int64_t i = begin; i < end; ++i) fn(i, VectorTerms{&scratch}, w.data());
        return;
      }
    }
#endif
    for (int64_t i = begin; i < end; ++i) fn(i, aev_math::ScalarTerms<scalar_t>{}, w.data());
  });
}

void check_tangent(const char* op, const at::Tensor& tangent, const at::Tensor& diff_vectors) {
  TORCH_CHECK(tangent.sizes() == diff_vectors.sizes(), op,
              ": tangent must have the shape of diff_vectors ", diff_vectors.sizes(), ", got ",
              tangent.sizes());
  TORCH_CHECK(at::isFloatingType(tangent.scalar_type()), op,
              ": tangent must be floating point, got ", tangent.scalar_type());
}

}  // namespace

at::Tensor aev_jvp_cpu(const at::Tensor& tangent, const at::Tensor& species,
                       const at::Tensor& pairs, const at::Tensor& diff_vectors,
                       const AEVParams& p) {
  const char* op = "torchani_fast::aev_jvp";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_tangent(op, tangent, diff_vectors);
  auto t = in.working(tangent);
  const int64_t N = in.N, P = in.P;
  const at::Tensor& sp = in.species;
  const at::Tensor& diff = in.diff;
  // Each row is zeroed by the thread that fills it, just before (jvp_center
  // adds to it): no separate pass over the whole (N, F) output first.
  auto out = at::empty(aev_shape(species, p), diff.options());
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_jvp_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p);
    std::vector<scalar_t> u;
    std::vector<uint8_t> moving;
    edge_directions(h, t.data_ptr<scalar_t>(), P, u, moving);
    const auto kv = k.view();
    const HalfEdgeView<scalar_t> hv(h, sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>());
    const int64_t* spp = sp.data_ptr<int64_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    std::vector<scalar_t> fcw(u.size());
    for_each_centre(N, kv, [&](int64_t i, auto terms, scalar_t* w) {
      scalar_t* row = o + i * kv.F;
      std::fill(row, row + kv.F, scalar_t(0));
      if (spp[i] < 0 || !aev_math::any_moving(hv, i, moving.data())) return;
      aev_math::jvp_radial_center(kv, hv, i, u.data(), moving.data(), row, terms);
#ifdef TF_SIMD_AVX2
      if constexpr (std::is_same_v<decltype(terms), VectorTerms>) {
        jvp_angular8(kv, hv, i, u.data(), moving.data(), w, fcw.data(), row, *terms.w);
        return;
      }
#endif
      aev_math::jvp_angular_center(kv, hv, i, u.data(), moving.data(), w, fcw.data(), row);
    });
  });
  return out;
}

at::Tensor aev_double_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                   const at::Tensor& species, const at::Tensor& pairs,
                                   const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_double_backward";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_tangent(op, tangent, diff_vectors);
  check_grad_aev(op, grad_aev, species, p);
  auto g = in.working(grad_aev);
  auto t = in.working(tangent);
  const int64_t N = in.N, P = in.P;
  const at::Tensor& sp = in.species;
  const at::Tensor& diff = in.diff;
  auto out = at::empty({P, 3}, diff.options());  // every row written by edges_to_pairs
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_double_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p);
    std::vector<scalar_t> u;
    std::vector<uint8_t> moving;
    edge_directions(h, t.data_ptr<scalar_t>(), P, u, moving);
    std::vector<scalar_t> out_edge(u.size(), scalar_t(0)), fcw(u.size());
    const auto kv = k.view();
    const HalfEdgeView<scalar_t> hv(h, sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>());
    const int64_t* spp = sp.data_ptr<int64_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    for_each_centre(N, kv, [&](int64_t i, auto terms, scalar_t* w) {
      if (spp[i] < 0 || !aev_math::any_moving(hv, i, moving.data())) return;
      const scalar_t* grow = gp + i * kv.F;
      aev_math::hvp_radial_center(kv, hv, i, grow, u.data(), moving.data(), out_edge.data(), terms);
#ifdef TF_SIMD_AVX2
      if constexpr (std::is_same_v<decltype(terms), VectorTerms>) {
        hvp_angular8(kv, hv, i, grow, u.data(), moving.data(), w, fcw.data(), out_edge.data(),
                     *terms.w);
        return;
      }
#endif
      aev_math::hvp_angular_center(kv, hv, i, grow, u.data(), moving.data(), w, fcw.data(),
                                   out_edge.data());
    });
    edges_to_pairs(h, out_edge.data(), P, out.data_ptr<scalar_t>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cpu(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_local_derivatives";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_grad_aev(op, grad_aev, species, p);
  TORCH_CHECK(columns.dim() == 1 && (columns.scalar_type() == at::kLong ||
                                     columns.scalar_type() == at::kInt),
              op, ": columns must be a 1-D int64 tensor, got ", columns.scalar_type(), " ",
              columns.sizes());
  const int64_t C = columns.numel();
  std::vector<int64_t> colmap(aev_length(p), -1);
  {
    auto cl = columns.to(at::kLong).contiguous();
    const int64_t* cp = cl.data_ptr<int64_t>();
    for (int64_t c = 0; c < C; ++c) {
      TORCH_CHECK(cp[c] >= 0 && cp[c] < aev_length(p) && (c == 0 || cp[c] > cp[c - 1]), op,
                  ": columns must be increasing AEV columns in [0, ", aev_length(p), "), got ",
                  cp[c], " at position ", c);
      colmap[cp[c]] = c;
    }
  }
  auto g = in.working(grad_aev);
  const int64_t N = in.N;
  const at::Tensor& sp = in.species;
  const at::Tensor& diff = in.diff;
  at::Tensor local_atoms, jac, curv;
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_local_derivatives_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p);
    const auto kv = k.view();
    const HalfEdgeView<scalar_t> hv(h, sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>());
    const int64_t* spp = sp.data_ptr<int64_t>();
    const int64_t E = h.edges();
    // Slots of each centre's neighbours (see local_slots_center), then K = the most.
    std::vector<int64_t> slot(E), first_pair(E), count(N, 1);
    torchani_fast::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (spp[i] >= 0) count[i] = aev_math::local_slots_center(hv, i, first_pair.data(),
                                                                 slot.data());
    });
    int64_t K = 1;
    for (int64_t i = 0; i < N; ++i) K = std::max(K, count[i]);
    local_atoms = at::full({N, K}, -1, at::TensorOptions().dtype(at::kLong));
    int64_t* la = local_atoms.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
      if (spp[i] < 0) continue;
      la[i * K] = i;
      for (int64_t e = h.start[i]; e < h.start[i + 1]; ++e) la[i * K + slot[e]] = h.other[e];
    }
    jac = at::zeros({N, K, 3, C}, diff.options());
    curv = at::zeros({N, K, 3, K, 3}, diff.options());
    scalar_t* jp = jac.data_ptr<scalar_t>();
    scalar_t* cp = curv.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    std::vector<scalar_t> fcw(3 * E);
    torchani_fast::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
      const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
      std::vector<scalar_t> w(aev_math::angular_scratch_len(kv));
      for (int64_t i = begin; i < end; ++i)
        if (spp[i] >= 0)
          aev_math::local_center(kv, hv, i, gp + i * kv.F, slot.data(), colmap.data(), C, K,
                                 w.data(), fcw.data(), jp + i * 3 * K * C,
                                 cp + i * 9 * K * K);
    });
  });
  return {local_atoms, jac, curv};
}

}  // namespace torchani_fast
