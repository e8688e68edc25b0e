// The math of the AEV's second derivatives, written once for both backends:
// aev/second_cpu.cpp calls these functions from at::parallel_for, and
// aev/cuda/second_cuda.cu from CUDA kernels (one thread per centre atom). Plain C++
// on raw pointers (no ATen, no std::vector, no exceptions), so nvcc can
// compile every function for the device: TF_HOST_DEVICE is __host__ __device__
// under nvcc and nothing for the host compiler.
//
// With aev = f(diff) and aev_backward(g, diff) = J(diff)^T g (J = d aev / d diff):
//
//   aev_jvp(t, diff)                = J(diff) t                    shape of aev
//   aev_double_backward(g, t, diff) = d/d diff <t, J(diff)^T g>    (P, 3)
//                                   = (sum_f g_f  d2 aev_f / d diff2) t
//   aev_local_derivatives(g, columns, diff)   per centre atom i, over the atoms
//       its AEV depends on: d aev_i / dx (the given AEV columns) and
//       sum_f g_if d2 aev_if / dx2.
//
// Per centre atom, with v = vector to a neighbour, r = |v|, h = v / r:
//   radial   phi(r)  = sum_s g_s 0.25 exp(-eta (r - Rs)^2) fc(r)
//            Hess(phi) u = phi'' (h.u) h + phi' / r (u - (h.u) h)
//   angular  Psi(q, r1, r2) = sum_az g_az f1_z(0.95 q) f2_a((r1 + r2) / 2) fc(r1) fc(r2)
//            with q = v1.v2 / (r1 r2); its Hessian along (u1, u2) is the chain
//            rule through the first and second derivatives of q, r1 and r2.
// When r1 r2 < 1e-10 TorchANI clamps the denominator of q (q = 1e10 v1.v2, a
// bilinear form), and at r = 0 the direction h is undefined: those terms are
// masked to zero, as in the first-derivative kernels, so no NaN appears.
//
// The per-centre functions take an edge view `h` for the half edges of the
// backend's own layout (aev/half_edges.h on the CPU, the sorted half edges of
// aev/cuda/aev_cuda.cu on CUDA):
//   h.begin(i), h.end(i)   the half edges owned by atom i (a contiguous range)
//   h.neighbor(e)          Neighbor: centre-to-neighbour vector, r, species, e
//   h.other(e), h.pair(e)  neighbour atom and pair index (local_slots_center only)
// Each half edge belongs to one centre atom, and each centre writes only its
// own AEV row, its own half edges and its own slots: no atomics, and the
// result does not depend on how the centres are spread over threads.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace torchani_fast {
namespace aev_math {

// The float or double function, on the host and on the device (the host
// versions are the ones std:: picks for these types, so the CPU bits do not
// depend on which spelling is used).
TF_HOST_DEVICE inline float m_exp(float x) { return ::expf(x); }
TF_HOST_DEVICE inline double m_exp(double x) { return ::exp(x); }
TF_HOST_DEVICE inline float m_pow(float x, float y) { return ::powf(x, y); }
TF_HOST_DEVICE inline double m_pow(double x, double y) { return ::pow(x, y); }
TF_HOST_DEVICE inline float m_cos(float x) { return ::cosf(x); }
TF_HOST_DEVICE inline double m_cos(double x) { return ::cos(x); }
TF_HOST_DEVICE inline float m_sin(float x) { return ::sinf(x); }
TF_HOST_DEVICE inline double m_sin(double x) { return ::sin(x); }
TF_HOST_DEVICE inline float m_sqrt(float x) { return ::sqrtf(x); }
TF_HOST_DEVICE inline double m_sqrt(double x) { return ::sqrt(x); }

constexpr double kPi = 3.14159265358979323846;

// The cosine cutoff from fc = 0.5 cos(pi r / rc) + 0.5 as TorchANI computes it.
// That rounds to exactly 0 over the last stretch below the cutoff (r > rc (1 -
// 7.8e-5) in float32: 0.4 mA for rc = 5.1 A; 5e-9 in float64), where its
// derivative does not vanish. There the accurate value, cos^2(pi r / (2 rc)) =
// sin^2(e) = e^2 to working precision, e = pi (rc - r) / (2 rc): so a neighbour
// inside the cutoff never leaves its AEV terms exactly 0, and an AEV block that
// is 0 means that the atom has no such neighbours, as FusedEnsemble's
// rare-element split assumes. (rc - r is exact there.) SIMD copy: aev/aev_cpu.cpp.
template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t cutoff_tail(scalar_t fc, scalar_t r, scalar_t rc) {
  if (fc != scalar_t(0) || !(r < rc)) return fc;
  const scalar_t e = (rc - r) * (scalar_t(kPi / 2) / rc);
  return e * e;
}
template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t cutoff_cos(scalar_t r, scalar_t rc) {
  return cutoff_tail(scalar_t(0.5) * m_cos(r * (scalar_t(kPi) / rc)) + scalar_t(0.5), r, rc);
}
template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t cutoff_cos_deriv(scalar_t r, scalar_t rc) {
  return scalar_t(-0.5) * (scalar_t(kPi) / rc) * m_sin(r * (scalar_t(kPi) / rc));
}
template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t cutoff_cos_deriv2(scalar_t r, scalar_t rc) {
  const scalar_t w = scalar_t(kPi) / rc;
  return scalar_t(-0.5) * w * w * m_cos(r * w);
}

// The cutoff function of both AEV terms, a parameter of every AEV op (schema
// arguments cutoff_kind, cutoff_order, cutoff_eps; TorchANI's torchani.cutoffs):
//   kCutoffCosine  fc = 0.5 cos(pi r / rc) + 0.5 (CutoffCosine, with cutoff_tail)
//   kCutoffSmooth  fc = exp(1 - 1 / max(eps, 1 - (r / rc)^n)) (CutoffSmooth(order
//                  n, eps)), computed in TorchANI's order of operations.
// The smooth cutoff's derivatives are fc times a factor, as autograd forms
// them from exp's result: where fc underflows to 0 (r > 0.9943 rc in float32,
// 0.9993 rc in float64 for n = 2) so do they, and where the eps clamp is active
// (fc = exp(1 - 1/eps), 0 for TorchANI's eps = 1e-10) they are 0. Unlike the
// cosine's tail there is no accurate value to keep in float32 (it is below the
// smallest float), so an AEV block can be exactly 0 with a neighbour in it: the
// Python AEVComputer reports zero_block_exact = False for this kind.
constexpr int64_t kCutoffCosine = 0;
constexpr int64_t kCutoffSmooth = 1;

template <typename scalar_t>
struct CutoffFn {
  int64_t kind = kCutoffCosine;
  int64_t order = 2;  // kCutoffSmooth: n >= 1
  scalar_t eps = scalar_t(1e-10);
};

// (r / rc)^n as TorchANI's x ** n: x * x for n = 2 (ATen's pow special case),
// repeated products otherwise (n is small).
template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t ipow(scalar_t x, int64_t n) {
  scalar_t p = x;
  for (int64_t j = 1; j < n; ++j) p *= x;
  return n <= 0 ? scalar_t(1) : p;
}

// The smooth cutoff's parts at r: u = max(eps, 1 - x^n), whether the clamp is
// inactive, and g = d log(fc) / dr = -n x^(n-1) / (rc u^2) (0 when clamped).
template <typename scalar_t>
struct SmoothParts {
  scalar_t x, u, fc, g;
  bool free;
};
template <typename scalar_t>
TF_HOST_DEVICE inline SmoothParts<scalar_t> smooth_parts(const CutoffFn<scalar_t>& f, scalar_t r,
                                                         scalar_t rc) {
  SmoothParts<scalar_t> s;
  s.x = r / rc;
  const scalar_t u = scalar_t(1) - ipow(s.x, f.order);
  s.free = u >= f.eps;  // (torch.clamp passes the gradient at u == eps)
  s.u = s.free ? u : f.eps;
  s.fc = m_exp(scalar_t(1) - scalar_t(1) / s.u);
  s.g = s.free ? -scalar_t(f.order) * ipow(s.x, f.order - 1) / (rc * s.u * s.u) : scalar_t(0);
  return s;
}

template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t cutoff_value(const CutoffFn<scalar_t>& f, scalar_t r, scalar_t rc) {
  if (f.kind == kCutoffCosine) return cutoff_cos(r, rc);
  return smooth_parts(f, r, rc).fc;
}
template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t cutoff_deriv(const CutoffFn<scalar_t>& f, scalar_t r, scalar_t rc) {
  if (f.kind == kCutoffCosine) return cutoff_cos_deriv(r, rc);
  const SmoothParts<scalar_t> s = smooth_parts(f, r, rc);
  return s.fc * s.g;
}
// fc'' = fc (g^2 + g'), g' = -n (n-1) x^(n-2) / (rc^2 u^2) - 2 n^2 x^(2n-2) / (rc^2 u^3).
template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t cutoff_deriv2(const CutoffFn<scalar_t>& f, scalar_t r, scalar_t rc) {
  if (f.kind == kCutoffCosine) return cutoff_cos_deriv2(r, rc);
  const SmoothParts<scalar_t> s = smooth_parts(f, r, rc);
  if (!s.free) return scalar_t(0);
  const scalar_t n = scalar_t(f.order);
  const scalar_t xn1 = ipow(s.x, f.order - 1);
  const scalar_t xn2 = f.order >= 2 ? ipow(s.x, f.order - 2) : scalar_t(0);
  const scalar_t inv = scalar_t(1) / (rc * rc * s.u * s.u);
  const scalar_t dg = -(n * (n - scalar_t(1)) * xn2 + scalar_t(2) * n * n * xn1 * xn1 / s.u) * inv;
  return s.fc * (s.g * s.g + dg);
}

// The AEV constants in the working dtype, every per-column array expanded to
// its full length (R, A, Z): raw pointers into host vectors (CPU) or a device
// buffer (CUDA).
template <typename scalar_t>
struct ConstView {
  int64_t S, R, A, Z, F, radial_len;
  scalar_t rc_r, rc_a;
  const scalar_t *eta_r, *shf_r, *eta_a, *shf_a, *zeta, *cos_z, *sin_z;
  CutoffFn<scalar_t> cut;  // of both terms

  // Row-major upper-triangular index of the species pair (s1, s2), as torchani's triu_index.
  TF_HOST_DEVICE int64_t pair_index(int64_t s1, int64_t s2) const {
    if (s1 > s2) {
      const int64_t t = s1;
      s1 = s2;
      s2 = t;
    }
    return s1 * S - s1 * (s1 - 1) / 2 + (s2 - s1);
  }
};

// One neighbour of the centre atom: vector from the centre to it, its length,
// its species and the half edge it came from.
template <typename scalar_t>
struct Neighbor {
  scalar_t v[3];
  scalar_t r;
  int64_t species;
  int64_t edge;
};

// The parts of one angular triple shared by all derivatives.
template <typename scalar_t>
struct Triple {
  scalar_t cos_raw;  // v1.v2 / max(r1 r2, 1e-10)
  scalar_t c;        // 0.95 * cos_raw, so |c| <= 0.95
  scalar_t sin_c;    // sqrt(1 - c^2) = sin(acos(c))
  scalar_t mean_r;   // (r1 + r2) / 2
  bool clamped;      // r1 r2 < 1e-10
};

template <typename scalar_t>
TF_HOST_DEVICE Triple<scalar_t> make_triple(const Neighbor<scalar_t>& n1,
                                            const Neighbor<scalar_t>& n2) {
  Triple<scalar_t> t;
  const scalar_t dot = n1.v[0] * n2.v[0] + n1.v[1] * n2.v[1] + n1.v[2] * n2.v[2];
  const scalar_t den = n1.r * n2.r;
  t.clamped = den < scalar_t(1e-10);
  t.cos_raw = dot / (t.clamped ? scalar_t(1e-10) : den);
  t.c = scalar_t(0.95) * t.cos_raw;
  const scalar_t one_minus = scalar_t(1) - t.c * t.c;
  t.sin_c = m_sqrt(one_minus < scalar_t(0) ? scalar_t(0) : one_minus);  // std::max(x, 0)
  t.mean_r = (n1.r + n2.r) / scalar_t(2);
  return t;
}

template <typename scalar_t>
TF_HOST_DEVICE inline scalar_t dot3(const scalar_t* a, const scalar_t* b) {
  return a[0] * b[0] + a[1] * b[1] + a[2] * b[2];
}

// First derivatives of q = cos_raw, r1 and r2 with respect to v1 and v2.
template <typename scalar_t>
struct TripleGrad {
  scalar_t h1[3], h2[3];    // dr1/dv1, dr2/dv2 (zero where r = 0)
  scalar_t gq1[3], gq2[3];  // dq/dv1, dq/dv2
};

template <typename scalar_t>
TF_HOST_DEVICE TripleGrad<scalar_t> triple_grad(const Neighbor<scalar_t>& n1,
                                                const Neighbor<scalar_t>& n2,
                                                const Triple<scalar_t>& t) {
  TripleGrad<scalar_t> d;
  for (int c = 0; c < 3; ++c) {
    d.h1[c] = n1.r > 0 ? n1.v[c] / n1.r : scalar_t(0);
    d.h2[c] = n2.r > 0 ? n2.v[c] / n2.r : scalar_t(0);
  }
  if (t.clamped) {
    for (int c = 0; c < 3; ++c) {
      d.gq1[c] = n2.v[c] * scalar_t(1e10);
      d.gq2[c] = n1.v[c] * scalar_t(1e10);
    }
  } else {
    for (int c = 0; c < 3; ++c) {
      d.gq1[c] = (d.h2[c] - t.cos_raw * d.h1[c]) / n1.r;
      d.gq2[c] = (d.h1[c] - t.cos_raw * d.h2[c]) / n2.r;
    }
  }
  return d;
}

// f1_z(c) = 2 ((1 + cos(acos(c) - ts_z)) / 2)^zeta_z and its first two
// derivatives with respect to c (c = 0.95 q, |c| <= 0.95 away from clamping).
template <typename scalar_t>
TF_HOST_DEVICE void angle_terms(const ConstView<scalar_t>& k, const Triple<scalar_t>& t,
                                scalar_t* f1, scalar_t* df1, scalar_t* d2f1) {
  const scalar_t s = t.sin_c;
  for (int64_t z = 0; z < k.Z; ++z) {
    const scalar_t zeta = k.zeta[z];
    const scalar_t cdev = t.c * k.cos_z[z] + s * k.sin_z[z];
    const scalar_t base = (scalar_t(1) + cdev) / scalar_t(2);
    // d cos(acos(c) - ts)/dc and its derivative -sin(ts) / (1 - c^2)^(3/2).
    const scalar_t d1 = k.cos_z[z] - t.c / s * k.sin_z[z];
    const bool from_pw2 = d2f1 != nullptr && zeta >= scalar_t(2);
    const scalar_t pw2 = from_pw2 ? m_pow(base, zeta - scalar_t(2)) : scalar_t(0);
    const scalar_t pw1 = from_pw2 ? pw2 * base : m_pow(base, zeta - scalar_t(1));
    f1[z] = scalar_t(2) * pw1 * base;
    df1[z] = zeta * pw1 * d1;
    if (d2f1) {
      const scalar_t d2 = -k.sin_z[z] / (s * s * s);
      d2f1[z] = zeta * (zeta - scalar_t(1)) / scalar_t(2) *
                    (from_pw2 ? pw2 : m_pow(base, zeta - scalar_t(2))) * d1 * d1 +
                zeta * pw1 * d2;
    }
  }
}

// f2_a(m) = exp(-eta_a (m - Rs_a)^2) and its first two derivatives in m.
template <typename scalar_t>
TF_HOST_DEVICE void distance_terms(const ConstView<scalar_t>& k, scalar_t mean_r, scalar_t* f2,
                                   scalar_t* df2, scalar_t* d2f2) {
  for (int64_t a = 0; a < k.A; ++a) {
    const scalar_t eta = k.eta_a[a];
    const scalar_t x = mean_r - k.shf_a[a];
    f2[a] = m_exp(-eta * x * x);
    df2[a] = scalar_t(-2) * eta * x * f2[a];
    if (d2f2) d2f2[a] = (scalar_t(4) * eta * eta * x * x - scalar_t(2) * eta) * f2[a];
  }
}

// phi(r) = sum_s g_s 0.25 exp(-eta_s (r - Rs_s)^2) fc(r): first and second
// derivatives (radial_phi); radial_phi_sums adds the terms of the shifts from
// `first` on, given the cutoff and its derivatives at r (the lane kernels' tail).
template <typename scalar_t>
TF_HOST_DEVICE void radial_phi_sums(const ConstView<scalar_t>& k, scalar_t r, const scalar_t* g,
                                    scalar_t fc, scalar_t dfc, scalar_t d2fc, int64_t first,
                                    scalar_t& phi1, scalar_t& phi2) {
  for (int64_t s = first; s < k.R; ++s) {
    const scalar_t eta = k.eta_r[s];
    const scalar_t x = r - k.shf_r[s];
    const scalar_t e = scalar_t(0.25) * m_exp(-eta * x * x);
    const scalar_t de = scalar_t(-2) * eta * x * e;
    const scalar_t d2e = (scalar_t(4) * eta * eta * x * x - scalar_t(2) * eta) * e;
    phi1 += g[s] * (de * fc + e * dfc);
    phi2 += g[s] * (d2e * fc + scalar_t(2) * de * dfc + e * d2fc);
  }
}
template <typename scalar_t>
TF_HOST_DEVICE void radial_phi(const ConstView<scalar_t>& k, scalar_t r, const scalar_t* g,
                               scalar_t& phi1, scalar_t& phi2) {
  phi1 = 0;
  phi2 = 0;
  radial_phi_sums(k, r, g, cutoff_value(k.cut, r, k.rc_r), cutoff_deriv(k.cut, r, k.rc_r),
                  cutoff_deriv2(k.cut, r, k.rc_r), 0, phi1, phi2);
}

// First and second derivatives of Psi(q, r1, r2) = sum_az g_az f1_z(0.95 q)
// f2_a((r1 + r2) / 2) fc(r1) fc(r2), the angular block of one triple contracted
// with g (q = cos_raw).
template <typename scalar_t>
struct PsiDerivs {
  scalar_t q, r1, r2, qq, q1, q2, r11, r22, r12;
};

// Scratch of the angular terms: f1, df1, d2f1 (Z each), then f2, df2, d2f2 (A each).
template <typename scalar_t>
TF_HOST_DEVICE inline int64_t angular_scratch_len(const ConstView<scalar_t>& k) {
  return 3 * k.Z + 3 * k.A;
}

// The angular terms of one triple into w (angular_scratch_len scalars):
// f1, df1 (and with `second` d2f1), then f2, df2 (d2f2) at their offsets.
template <typename scalar_t>
TF_HOST_DEVICE inline void angular_terms(const ConstView<scalar_t>& k, const Triple<scalar_t>& t,
                                         bool second, scalar_t* w) {
  scalar_t* f2 = w + 3 * k.Z;
  angle_terms<scalar_t>(k, t, w, w + k.Z, second ? w + 2 * k.Z : nullptr);
  distance_terms<scalar_t>(k, t.mean_r, f2, f2 + k.A, second ? f2 + 2 * k.A : nullptr);
}

// fc*, dfc*, d2fc*: the angular cutoff and its derivatives at r1 and r2; w:
// the triple's angular terms with second derivatives (angular_terms).
template <typename scalar_t>
TF_HOST_DEVICE PsiDerivs<scalar_t> psi_contract(const ConstView<scalar_t>& k, const scalar_t* g,
                                                scalar_t fc1, scalar_t fc2, scalar_t dfc1,
                                                scalar_t dfc2, scalar_t d2fc1, scalar_t d2fc2,
                                                const scalar_t* w) {
  const scalar_t *f1 = w, *df1 = w + k.Z, *d2f1 = w + 2 * k.Z;
  const scalar_t *f2 = w + 3 * k.Z, *df2 = f2 + k.A, *d2f2 = f2 + 2 * k.A;
  // S_mn = sum_az g_az f1^(m)_z f2^(n)_a: derivatives of the contracted block
  // with respect to c (m times) and to the mean distance (n times).
  scalar_t s00 = 0, s01 = 0, s02 = 0, s10 = 0, s11 = 0, s20 = 0;
  for (int64_t a = 0; a < k.A; ++a) {
    scalar_t r0 = 0, r1 = 0, r2 = 0;
    for (int64_t z = 0; z < k.Z; ++z) {
      const scalar_t gz = g[a * k.Z + z];
      r0 += gz * f1[z];
      r1 += gz * df1[z];
      r2 += gz * d2f1[z];
    }
    s00 += r0 * f2[a];
    s01 += r0 * df2[a];
    s02 += r0 * d2f2[a];
    s10 += r1 * f2[a];
    s11 += r1 * df2[a];
    s20 += r2 * f2[a];
  }
  // Chain rule with dc/dq = 0.95 and dm/dr1 = dm/dr2 = 1/2.
  const scalar_t C = fc1 * fc2;
  const scalar_t k95 = scalar_t(0.95);
  PsiDerivs<scalar_t> p;
  p.q = k95 * C * s10;
  p.r1 = scalar_t(0.5) * C * s01 + dfc1 * fc2 * s00;
  p.r2 = scalar_t(0.5) * C * s01 + fc1 * dfc2 * s00;
  p.qq = k95 * k95 * C * s20;
  p.q1 = k95 * (scalar_t(0.5) * C * s11 + dfc1 * fc2 * s10);
  p.q2 = k95 * (scalar_t(0.5) * C * s11 + fc1 * dfc2 * s10);
  p.r11 = scalar_t(0.25) * C * s02 + dfc1 * fc2 * s01 + d2fc1 * fc2 * s00;
  p.r22 = scalar_t(0.25) * C * s02 + fc1 * dfc2 * s01 + fc1 * d2fc2 * s00;
  p.r12 = scalar_t(0.25) * C * s02 + scalar_t(0.5) * (dfc1 * fc2 + fc1 * dfc2) * s01 +
          dfc1 * dfc2 * s00;
  return p;
}

// psi_contract of the triple t, whose angular terms it leaves in w.
template <typename scalar_t>
TF_HOST_DEVICE PsiDerivs<scalar_t> psi_derivs(const ConstView<scalar_t>& k,
                                              const Triple<scalar_t>& t, const scalar_t* g,
                                              scalar_t fc1, scalar_t fc2, scalar_t dfc1,
                                              scalar_t dfc2, scalar_t d2fc1, scalar_t d2fc2,
                                              scalar_t* w) {
  angular_terms(k, t, /*second=*/true, w);
  return psi_contract(k, g, fc1, fc2, dfc1, dfc2, d2fc1, d2fc2, w);
}

// (o1, o2) += Hess_{v1,v2}(Psi) (u1, u2): the chain rule through q, r1, r2.
template <typename scalar_t>
TF_HOST_DEVICE void triple_hvp(const Neighbor<scalar_t>& n1, const Neighbor<scalar_t>& n2,
                               const Triple<scalar_t>& t, const TripleGrad<scalar_t>& d,
                               const PsiDerivs<scalar_t>& p, const scalar_t* u1,
                               const scalar_t* u2, scalar_t* o1, scalar_t* o2) {
  const scalar_t dq = dot3(d.gq1, u1) + dot3(d.gq2, u2);
  const scalar_t a1 = dot3(d.h1, u1), b1 = dot3(d.h2, u1);
  const scalar_t a2 = dot3(d.h1, u2), b2 = dot3(d.h2, u2);
  const scalar_t dr1 = a1, dr2 = b2;
  const scalar_t c_q = p.qq * dq + p.q1 * dr1 + p.q2 * dr2;
  const scalar_t c_1 = p.q1 * dq + p.r11 * dr1 + p.r12 * dr2;
  const scalar_t c_2 = p.q2 * dq + p.r12 * dr1 + p.r22 * dr2;
  // Second-order geometry: (d2q/dv1 dv) u, (d2q/dv2 dv) u and d2 r_i / dv_i^2 u_i.
  scalar_t hq1[3], hq2[3];
  const scalar_t q = t.cos_raw;
  if (t.clamped) {
    for (int c = 0; c < 3; ++c) {
      hq1[c] = u2[c] * scalar_t(1e10);
      hq2[c] = u1[c] * scalar_t(1e10);
    }
  } else {
    const scalar_t r1 = n1.r, r2 = n2.r;
    const scalar_t i11 = scalar_t(1) / (r1 * r1), i22 = scalar_t(1) / (r2 * r2),
                   i12 = scalar_t(1) / (r1 * r2);
    for (int c = 0; c < 3; ++c) {
      const scalar_t x1 = d.h1[c], x2 = d.h2[c];
      hq1[c] = (-a1 * x2 - b1 * x1 + scalar_t(3) * q * a1 * x1 - q * u1[c]) * i11 +
               (u2[c] - b2 * x2 - a2 * x1 + q * b2 * x1) * i12;
      hq2[c] = (u1[c] - b1 * x2 - a1 * x1 + q * a1 * x2) * i12 +
               (-b2 * x1 - a2 * x2 + scalar_t(3) * q * b2 * x2 - q * u2[c]) * i22;
    }
  }
  for (int c = 0; c < 3; ++c) {
    const scalar_t hr1 = n1.r > 0 ? (u1[c] - a1 * d.h1[c]) / n1.r : scalar_t(0);
    const scalar_t hr2 = n2.r > 0 ? (u2[c] - b2 * d.h2[c]) / n2.r : scalar_t(0);
    o1[c] += c_q * d.gq1[c] + c_1 * d.h1[c] + p.q * hq1[c] + p.r1 * hr1;
    o2[c] += c_q * d.gq2[c] + c_2 * d.h2[c] + p.q * hq2[c] + p.r2 * hr2;
  }
}

// o += (phi'' h h^T + phi' / r (I - h h^T)) u, the radial Hessian along u (r > 0).
template <typename scalar_t>
TF_HOST_DEVICE void radial_hvp(const Neighbor<scalar_t>& n, scalar_t phi1, scalar_t phi2,
                               const scalar_t* u, scalar_t* o) {
  const scalar_t hu = dot3(n.v, u) / n.r;
  for (int c = 0; c < 3; ++c) {
    const scalar_t hc = n.v[c] / n.r;
    o[c] += phi2 * hu * hc + phi1 / n.r * (u[c] - hu * hc);
  }
}

// ---------------------------------------------------------------------------
// Per pair and per centre atom

// Pair direction t (3,) -> directions of its two half edges in their owners'
// frames (the vector to the neighbour is -diff for the edge e0 owned by i0,
// +diff for e1), and whether the pair moves at all.
template <typename scalar_t>
TF_HOST_DEVICE void edge_direction(int64_t e0, int64_t e1, const scalar_t* t, scalar_t* u,
                                   uint8_t* moving) {
  const uint8_t m = t[0] != 0 || t[1] != 0 || t[2] != 0;
  moving[e0] = moving[e1] = m;
  for (int c = 0; c < 3; ++c) {
    u[3 * e0 + c] = -t[c];
    u[3 * e1 + c] = t[c];
  }
}

// The angular cutoff and its first two derivatives of each half edge of
// centre i within the angular cutoff, into fcw (3 per half edge).
template <typename scalar_t, typename Edges>
TF_HOST_DEVICE void angular_cutoffs(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                    bool second, scalar_t* fcw) {
  for (int64_t e = h.begin(i); e < h.end(i); ++e) {
    const scalar_t r = h.neighbor(e).r;
    if (!(r <= k.rc_a)) continue;
    fcw[3 * e] = cutoff_value(k.cut, r, k.rc_a);
    fcw[3 * e + 1] = cutoff_deriv(k.cut, r, k.rc_a);
    if (second) fcw[3 * e + 2] = cutoff_deriv2(k.cut, r, k.rc_a);
  }
}

// True where any half edge of centre i has a nonzero direction.
template <typename Edges>
TF_HOST_DEVICE bool any_moving(const Edges& h, int64_t i, const uint8_t* moving) {
  for (int64_t e = h.begin(i); e < h.end(i); ++e)
    if (moving[e]) return true;
  return false;
}

// o[s] += dr d rad_s / dr for each radial shift s from `first` on (rad_s = 0.25
// exp(-eta_s (r - Rs_s)^2) fc(r), fc and dfc its cutoff and the cutoff's
// derivative at r).
template <typename scalar_t>
TF_HOST_DEVICE void radial_jvp(const ConstView<scalar_t>& k, scalar_t r, scalar_t fc, scalar_t dfc,
                               scalar_t dr, scalar_t* o, int64_t first = 0) {
  for (int64_t s = first; s < k.R; ++s) {
    const scalar_t x = r - k.shf_r[s];
    const scalar_t ex = scalar_t(0.25) * m_exp(-k.eta_r[s] * x * x);
    o[s] += dr * ex * (dfc - scalar_t(2) * k.eta_r[s] * x * fc);
  }
}

// Whether jvp_center and hvp_center visit the triple of the half edges e1 <
// e2 (distances r1, r2): both within the angular cutoff and one of them moving.
template <typename scalar_t>
TF_HOST_DEVICE inline bool visits_triple(const ConstView<scalar_t>& k, scalar_t r1, scalar_t r2,
                                         const uint8_t* moving, int64_t e1, int64_t e2) {
  return r1 <= k.rc_a && r2 <= k.rc_a && (moving[e1] || moving[e2]);
}

// How jvp_center and hvp_center compute their radial sums (per half edge) and
// their angular halves (per triple): one value at a time, here (CUDA, CPUs
// without AVX2). The CPU's vectorised policies (aev/second_lanes.h) compute
// the same formulas several shifts or triples at a time.
template <typename scalar_t>
struct ScalarTerms {
  TF_HOST_DEVICE void radial_jvp(const ConstView<scalar_t>& k, scalar_t r, scalar_t fc,
                                 scalar_t dfc, scalar_t dr, scalar_t* o) const {
    aev_math::radial_jvp(k, r, fc, dfc, dr, o);
  }
  TF_HOST_DEVICE void radial_phi(const ConstView<scalar_t>& k, scalar_t r, const scalar_t* g,
                                 scalar_t& phi1, scalar_t& phi2) const {
    aev_math::radial_phi(k, r, g, phi1, phi2);
  }
  // The angular halves (jvp_angular_center, hvp_angular_center, below).
  template <typename Edges>
  TF_HOST_DEVICE void jvp_angular(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                  const scalar_t* u_edge, const uint8_t* moving, scalar_t* w,
                                  scalar_t* fcw, scalar_t* row) const;
  template <typename Edges>
  TF_HOST_DEVICE void hvp_angular(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                  const scalar_t* grow, const scalar_t* u_edge,
                                  const uint8_t* moving, scalar_t* w, scalar_t* fcw,
                                  scalar_t* out_edge) const;
};

// row += J_i u: the directional derivative of centre i's AEV row along the
// half-edge directions u_edge (3 per half edge). w: angular_scratch_len
// scalars, fcw: 3 per half edge (this centre's entries are overwritten).
// In two halves, as hvp_center: the radial terms and the angular terms.
template <typename scalar_t, typename Edges, typename Terms = ScalarTerms<scalar_t>>
TF_HOST_DEVICE void jvp_radial_center(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                      const scalar_t* u_edge, const uint8_t* moving,
                                      scalar_t* row, const Terms& terms = Terms()) {
  for (int64_t e = h.begin(i); e < h.end(i); ++e) {
    if (!moving[e]) continue;
    const Neighbor<scalar_t> n = h.neighbor(e);
    if (!(n.r > 0)) continue;
    const scalar_t dr = dot3(n.v, u_edge + 3 * e) / n.r;
    terms.radial_jvp(k, n.r, cutoff_value(k.cut, n.r, k.rc_r), cutoff_deriv(k.cut, n.r, k.rc_r),
                     dr, row + n.species * k.R);
  }
}

// One triple's part of jvp_center: w, its angular terms (angular_terms, first
// derivatives), fcw the angular cutoffs (angular_cutoffs).
template <typename scalar_t>
TF_HOST_DEVICE void jvp_triple(const ConstView<scalar_t>& k, const Neighbor<scalar_t>& n1,
                               const Neighbor<scalar_t>& n2, const Triple<scalar_t>& t,
                               const scalar_t* u_edge, const scalar_t* fcw, const scalar_t* w,
                               scalar_t* row) {
  const int64_t e1 = n1.edge, e2 = n2.edge;
  const scalar_t* u1 = u_edge + 3 * e1;
  const scalar_t* u2 = u_edge + 3 * e2;
  const TripleGrad<scalar_t> d = triple_grad(n1, n2, t);
  const scalar_t dq = dot3(d.gq1, u1) + dot3(d.gq2, u2);
  const scalar_t dr1 = dot3(d.h1, u1), dr2 = dot3(d.h2, u2);
  const scalar_t *f1 = w, *df1 = w + k.Z, *f2 = w + 3 * k.Z, *df2 = f2 + k.A;
  const scalar_t fc1 = fcw[3 * e1], fc2 = fcw[3 * e2];
  const scalar_t fcc = fc1 * fc2;
  const scalar_t dfcc = fcw[3 * e1 + 1] * fc2 * dr1 + fc1 * fcw[3 * e2 + 1] * dr2;
  const scalar_t cq = scalar_t(0.95) * dq * fcc;
  const scalar_t cm = scalar_t(0.5) * (dr1 + dr2) * fcc;
  scalar_t* o = row + k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z;
  for (int64_t a = 0; a < k.A; ++a) {
    const scalar_t pa = cq * f2[a];
    const scalar_t qa = cm * df2[a] + dfcc * f2[a];
    for (int64_t z = 0; z < k.Z; ++z) o[a * k.Z + z] += pa * df1[z] + qa * f1[z];
  }
}

template <typename scalar_t, typename Edges>
TF_HOST_DEVICE void jvp_angular_center(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                       const scalar_t* u_edge, const uint8_t* moving,
                                       scalar_t* w, scalar_t* fcw, scalar_t* row) {
  const int64_t begin = h.begin(i), end = h.end(i);
  angular_cutoffs(k, h, i, /*second=*/false, fcw);
  for (int64_t e1 = begin; e1 < end; ++e1) {
    const Neighbor<scalar_t> n1 = h.neighbor(e1);
    if (!(n1.r <= k.rc_a)) continue;
    for (int64_t e2 = e1 + 1; e2 < end; ++e2) {
      const Neighbor<scalar_t> n2 = h.neighbor(e2);
      if (!visits_triple(k, n1.r, n2.r, moving, e1, e2)) continue;
      const Triple<scalar_t> t = make_triple(n1, n2);
      angular_terms(k, t, /*second=*/false, w);
      jvp_triple(k, n1, n2, t, u_edge, fcw, w, row);
    }
  }
}

template <typename scalar_t>
template <typename Edges>
TF_HOST_DEVICE void ScalarTerms<scalar_t>::jvp_angular(const ConstView<scalar_t>& k,
                                                       const Edges& h, int64_t i,
                                                       const scalar_t* u_edge,
                                                       const uint8_t* moving, scalar_t* w,
                                                       scalar_t* fcw, scalar_t* row) const {
  jvp_angular_center(k, h, i, u_edge, moving, w, fcw, row);
}

template <typename scalar_t, typename Edges, typename Terms = ScalarTerms<scalar_t>>
TF_HOST_DEVICE void jvp_center(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                               const scalar_t* u_edge, const uint8_t* moving, scalar_t* w,
                               scalar_t* fcw, scalar_t* row, const Terms& terms = Terms()) {
  if (!any_moving(h, i, moving)) return;
  jvp_radial_center(k, h, i, u_edge, moving, row, terms);
  terms.jvp_angular(k, h, i, u_edge, moving, w, fcw, row);
}

// out_edge += (sum_f g_if Hess(aev_if)) u for the half edges of centre i (the
// gradient with respect to each half-edge vector). grow: centre i's grad_aev row.
// In two halves: the radial terms (per half edge) and the angular terms (per
// triple), which the CPU's vectorised Terms replace (aev/second_lanes.h).
template <typename scalar_t, typename Edges, typename Terms = ScalarTerms<scalar_t>>
TF_HOST_DEVICE void hvp_radial_center(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                      const scalar_t* grow, const scalar_t* u_edge,
                                      const uint8_t* moving, scalar_t* out_edge,
                                      const Terms& terms = Terms()) {
  for (int64_t e = h.begin(i); e < h.end(i); ++e) {
    if (!moving[e]) continue;
    const Neighbor<scalar_t> n = h.neighbor(e);
    if (!(n.r > 0)) continue;
    scalar_t phi1, phi2;
    terms.radial_phi(k, n.r, grow + n.species * k.R, phi1, phi2);
    radial_hvp(n, phi1, phi2, u_edge + 3 * e, out_edge + 3 * e);
  }
}

// The angular terms' part of one triple (n1, n2 of the half edges e1, e2): the
// gradient contraction p (psi_contract), then the chain rule through the geometry.
template <typename scalar_t>
TF_HOST_DEVICE void hvp_triple(const Neighbor<scalar_t>& n1, const Neighbor<scalar_t>& n2,
                               const Triple<scalar_t>& t, const PsiDerivs<scalar_t>& p,
                               const scalar_t* u_edge, scalar_t* out_edge) {
  const int64_t e1 = n1.edge, e2 = n2.edge;
  const TripleGrad<scalar_t> d = triple_grad(n1, n2, t);
  triple_hvp(n1, n2, t, d, p, u_edge + 3 * e1, u_edge + 3 * e2, out_edge + 3 * e1,
             out_edge + 3 * e2);
}

// The contraction of triple t of centre i with its grad_aev block, from the
// triple's angular terms w (angular_terms with second derivatives) and the
// angular cutoffs fcw (angular_cutoffs).
template <typename scalar_t>
TF_HOST_DEVICE PsiDerivs<scalar_t> triple_psi(const ConstView<scalar_t>& k,
                                              const Neighbor<scalar_t>& n1,
                                              const Neighbor<scalar_t>& n2, const scalar_t* grow,
                                              const scalar_t* fcw, const scalar_t* w) {
  const int64_t e1 = n1.edge, e2 = n2.edge;
  const scalar_t* g = grow + k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z;
  return psi_contract(k, g, fcw[3 * e1], fcw[3 * e2], fcw[3 * e1 + 1], fcw[3 * e2 + 1],
                      fcw[3 * e1 + 2], fcw[3 * e2 + 2], w);
}

template <typename scalar_t, typename Edges>
TF_HOST_DEVICE void hvp_angular_center(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                       const scalar_t* grow, const scalar_t* u_edge,
                                       const uint8_t* moving, scalar_t* w, scalar_t* fcw,
                                       scalar_t* out_edge) {
  const int64_t begin = h.begin(i), end = h.end(i);
  angular_cutoffs(k, h, i, /*second=*/true, fcw);
  for (int64_t e1 = begin; e1 < end; ++e1) {
    const Neighbor<scalar_t> n1 = h.neighbor(e1);
    if (!(n1.r <= k.rc_a)) continue;
    for (int64_t e2 = e1 + 1; e2 < end; ++e2) {
      const Neighbor<scalar_t> n2 = h.neighbor(e2);
      if (!visits_triple(k, n1.r, n2.r, moving, e1, e2)) continue;
      const Triple<scalar_t> t = make_triple(n1, n2);
      angular_terms(k, t, /*second=*/true, w);
      hvp_triple(n1, n2, t, triple_psi(k, n1, n2, grow, fcw, w), u_edge, out_edge);
    }
  }
}

template <typename scalar_t>
template <typename Edges>
TF_HOST_DEVICE void ScalarTerms<scalar_t>::hvp_angular(const ConstView<scalar_t>& k,
                                                       const Edges& h, int64_t i,
                                                       const scalar_t* grow,
                                                       const scalar_t* u_edge,
                                                       const uint8_t* moving, scalar_t* w,
                                                       scalar_t* fcw, scalar_t* out_edge) const {
  hvp_angular_center(k, h, i, grow, u_edge, moving, w, fcw, out_edge);
}

template <typename scalar_t, typename Edges, typename Terms = ScalarTerms<scalar_t>>
TF_HOST_DEVICE void hvp_center(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                               const scalar_t* grow, const scalar_t* u_edge,
                               const uint8_t* moving, scalar_t* w, scalar_t* fcw,
                               scalar_t* out_edge, const Terms& terms = Terms()) {
  if (!any_moving(h, i, moving)) return;
  hvp_radial_center(k, h, i, grow, u_edge, moving, out_edge, terms);
  terms.hvp_angular(k, h, i, grow, u_edge, moving, w, fcw, out_edge);
}

// Slots of the atoms centre i depends on: slot 0 is the centre itself, then its
// distinct neighbour atoms in order of their first pair index (a neighbour seen
// through several periodic images, or the centre's own image, shares a slot).
// Writes slot[e] for the half edges of i (first_pair: scratch, one per half
// edge) and returns the number of slots. O(edges^2), independent of the order
// of the half edges inside the centre's range.
template <typename Edges>
TF_HOST_DEVICE int64_t local_slots_center(const Edges& h, int64_t i, int64_t* first_pair,
                                          int64_t* slot) {
  const int64_t begin = h.begin(i), end = h.end(i);
  // The smallest pair index through which each neighbour atom appears.
  for (int64_t e = begin; e < end; ++e) {
    const int64_t o = h.other(e);
    int64_t m = h.pair(e);
    for (int64_t f = begin; f < end; ++f)
      if (h.other(f) == o && h.pair(f) < m) m = h.pair(f);
    first_pair[e] = m;
  }
  // A neighbour's slot: 1 + the number of other neighbours that appear first.
  // (A pair index belongs to one half edge of i unless it is i's own image.)
  int64_t count = 1;
  for (int64_t e = begin; e < end; ++e) {
    if (h.other(e) == i) {
      slot[e] = 0;
      continue;
    }
    int64_t s = 1;
    for (int64_t f = begin; f < end; ++f)
      if (h.other(f) != i && first_pair[f] == h.pair(f) && h.pair(f) < first_pair[e]) ++s;
    slot[e] = s;
    if (s + 1 > count) count = s + 1;
  }
  return count;
}

// B (3 x 3, an edge-space block for the half edges with slots sa, sb) into the
// slot-space curvature Hc (3K x 3K): v_e = x_nbr(e) - x_i + shift, so it lands
// on (sa, sb) and (0, 0) with +B, on (sa, 0) and (0, sb) with -B.
template <typename scalar_t>
TF_HOST_DEVICE void add_block(scalar_t* Hc, int64_t K3, int64_t sa, int64_t sb,
                              const scalar_t (&B)[3][3]) {
  for (int c = 0; c < 3; ++c)
    for (int d = 0; d < 3; ++d) {
      const scalar_t v = B[c][d];
      Hc[(3 * sa + c) * K3 + 3 * sb + d] += v;
      Hc[c * K3 + d] += v;
      Hc[(3 * sa + c) * K3 + d] -= v;
      Hc[c * K3 + 3 * sb + d] -= v;
    }
}

// For centre i, in the slots' coordinates x_s:
//   J[s, c, f']        += d aev_if / d x_{s,c}, f = columns[f']  (J: K x 3 x C)
//   Hc[s, c, s', c']   += sum_f g_if d2 aev_if / d x_{s,c} d x_{s',c'}  (3K x 3K)
// colmap: AEV column -> column of J, or -1 for columns not asked for.
template <typename scalar_t, typename Edges>
TF_HOST_DEVICE void local_center(const ConstView<scalar_t>& k, const Edges& h, int64_t i,
                                 const scalar_t* grow, const int64_t* slot,
                                 const int64_t* colmap, int64_t C, int64_t K, scalar_t* w,
                                 scalar_t* fcw, scalar_t* J, scalar_t* Hc) {
  const int64_t K3 = 3 * K;
  const int64_t begin = h.begin(i), end = h.end(i);
  for (int64_t e = begin; e < end; ++e) {
    const Neighbor<scalar_t> n = h.neighbor(e);
    if (!(n.r > 0)) continue;
    const int64_t sl = slot[e];
    const scalar_t fc = cutoff_value(k.cut, n.r, k.rc_r);
    const scalar_t dfc = cutoff_deriv(k.cut, n.r, k.rc_r);
    scalar_t hv[3];
    for (int c = 0; c < 3; ++c) hv[c] = n.v[c] / n.r;
    const int64_t off = n.species * k.R;
    for (int64_t s = 0; s < k.R; ++s) {
      const int64_t col = colmap[off + s];
      if (col < 0) continue;
      const scalar_t x = n.r - k.shf_r[s];
      const scalar_t ex = scalar_t(0.25) * m_exp(-k.eta_r[s] * x * x);
      const scalar_t dr = ex * (dfc - scalar_t(2) * k.eta_r[s] * x * fc);
      for (int c = 0; c < 3; ++c) {
        J[(3 * sl + c) * C + col] += dr * hv[c];
        J[c * C + col] -= dr * hv[c];
      }
    }
    scalar_t phi1, phi2;
    radial_phi(k, n.r, grow + off, phi1, phi2);
    scalar_t B[3][3];
    for (int c = 0; c < 3; ++c)
      for (int d = 0; d < 3; ++d)
        B[c][d] = (phi2 - phi1 / n.r) * hv[c] * hv[d] + (c == d ? phi1 / n.r : scalar_t(0));
    add_block(Hc, K3, sl, sl, B);
  }
  angular_cutoffs(k, h, i, /*second=*/true, fcw);
  const scalar_t *f1 = w, *df1 = w + k.Z, *f2 = w + 3 * k.Z, *df2 = f2 + k.A;
  for (int64_t e1 = begin; e1 < end; ++e1) {
    const Neighbor<scalar_t> n1 = h.neighbor(e1);
    if (!(n1.r <= k.rc_a)) continue;
    for (int64_t e2 = e1 + 1; e2 < end; ++e2) {
      const Neighbor<scalar_t> n2 = h.neighbor(e2);
      if (!(n2.r <= k.rc_a)) continue;
      const int64_t s1 = slot[e1], s2 = slot[e2];
      const Triple<scalar_t> t = make_triple(n1, n2);
      const TripleGrad<scalar_t> d = triple_grad(n1, n2, t);
      const int64_t off = k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z;
      const scalar_t fc1 = fcw[3 * e1], fc2 = fcw[3 * e2];
      const scalar_t dfc1 = fcw[3 * e1 + 1], dfc2 = fcw[3 * e2 + 1];
      // Also leaves f1, df1, f2, df2 of this triple in w.
      const PsiDerivs<scalar_t> p =
          psi_derivs(k, t, grow + off, fc1, fc2, dfc1, dfc2, fcw[3 * e1 + 2], fcw[3 * e2 + 2], w);
      const scalar_t fcc = fc1 * fc2;
      const scalar_t dc1 = dfc1 * fc2, dc2 = fc1 * dfc2;
      for (int64_t a = 0; a < k.A; ++a) {
        const scalar_t cq_a = scalar_t(0.95) * f2[a] * fcc;
        const scalar_t m_a = scalar_t(0.5) * df2[a] * fcc;
        const scalar_t r1_a = m_a + f2[a] * dc1, r2_a = m_a + f2[a] * dc2;
        for (int64_t z = 0; z < k.Z; ++z) {
          const int64_t col = colmap[off + a * k.Z + z];
          if (col < 0) continue;
          const scalar_t cq = cq_a * df1[z], cr1 = r1_a * f1[z], cr2 = r2_a * f1[z];
          for (int c = 0; c < 3; ++c) {
            const scalar_t v1 = cq * d.gq1[c] + cr1 * d.h1[c];
            const scalar_t v2 = cq * d.gq2[c] + cr2 * d.h2[c];
            J[(3 * s1 + c) * C + col] += v1;
            J[(3 * s2 + c) * C + col] += v2;
            J[c * C + col] -= v1 + v2;
          }
        }
      }
      // The 6 x 6 edge-space Hessian, one unit direction at a time.
      scalar_t B11[3][3], B12[3][3], B21[3][3], B22[3][3];
      for (int dir = 0; dir < 6; ++dir) {
        scalar_t u1[3] = {0, 0, 0}, u2[3] = {0, 0, 0}, o1[3] = {0, 0, 0}, o2[3] = {0, 0, 0};
        (dir < 3 ? u1 : u2)[dir % 3] = scalar_t(1);
        triple_hvp(n1, n2, t, d, p, u1, u2, o1, o2);
        for (int c = 0; c < 3; ++c) {
          (dir < 3 ? B11 : B12)[c][dir % 3] = o1[c];
          (dir < 3 ? B21 : B22)[c][dir % 3] = o2[c];
        }
      }
      add_block(Hc, K3, s1, s1, B11);
      add_block(Hc, K3, s1, s2, B12);
      add_block(Hc, K3, s2, s1, B21);
      add_block(Hc, K3, s2, s2, B22);
    }
  }
}

}  // namespace aev_math
}  // namespace torchani_fast
