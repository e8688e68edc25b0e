// CPU second derivatives of the AEV: the two halves of aev_backward's backward,
// and the per-atom derivatives from which whole Hessians are assembled.
//
// With aev = f(diff) and aev_backward(g, diff) = J(diff)^T g (J = d aev / d diff):
//
//   aev_jvp(t, diff)                = J(diff) t                    shape of aev
//   aev_double_backward(g, t, diff) = d/d diff <t, J(diff)^T g>    (P, 3)
//                                   = (sum_f g_f  d2 aev_f / d diff2) t
//
// The first is the derivative of aev_backward with respect to grad_aev (force
// training), the second its derivative with respect to diff_vectors (Hessians).
// Triples and radial terms whose half edges all have a zero direction
// contribute exactly zero and are skipped: a Hessian column (one coordinate
// moved) then costs the neighbourhood of that atom, not the whole system.
//
//   aev_local_derivatives(g, columns, diff)   per centre atom i, over the atoms
//       its AEV depends on: d aev_i / dx (the given AEV columns) and
//       sum_f g_if d2 aev_if / dx2 (torchani_fast/grad.py builds whole
//       Hessians from them without one autograd pass per coordinate).
//
// Same layout as aev_cpu.cpp: pairs become half edges owned by one atom, each
// atom's AEV row depends only on its own half edges, so the loop over centre
// atoms writes disjoint outputs (no atomics, same bits for any thread count).
//
// Per centre atom, with v = vector to a neighbour, r = |v|, h = v / r:
//   radial   phi(r)  = sum_s g_s 0.25 exp(-eta (r - Rs)^2) fc(r)
//            Hess(phi) u = phi'' (h.u) h + phi' / r (u - (h.u) h)
//   angular  Psi(q, r1, r2) = sum_az g_az f1_z(0.95 q) f2_a((r1 + r2) / 2) fc(r1) fc(r2)
//            with q = v1.v2 / (r1 r2); its Hessian along (u1, u2) is the chain
//            rule through the first and second derivatives of q, r1 and r2.
// When r1 r2 < 1e-10 TorchANI clamps the denominator of q (q = 1e10 v1.v2, a
// bilinear form), and at r = 0 the direction h is undefined: those terms are
// masked to zero, as in the first-derivative kernel, so no NaN appears.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "aev_cpu_common.h"

namespace torchani_fast {

using namespace aev_cpu_detail;

namespace {

template <typename scalar_t>
inline scalar_t dot3(const scalar_t* a, const scalar_t* b) {
  return a[0] * b[0] + a[1] * b[1] + a[2] * b[2];
}

// First derivatives of q = cos_raw, r1 and r2 with respect to v1 and v2.
template <typename scalar_t>
struct TripleGrad {
  scalar_t h1[3], h2[3];    // dr1/dv1, dr2/dv2 (zero where r = 0)
  scalar_t gq1[3], gq2[3];  // dq/dv1, dq/dv2
};

template <typename scalar_t>
TripleGrad<scalar_t> triple_grad(const Neighbor<scalar_t>& n1, const Neighbor<scalar_t>& n2,
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
void angle_terms(const Consts<scalar_t>& k, const Triple<scalar_t>& t, scalar_t* f1, scalar_t* df1,
                 scalar_t* d2f1) {
  const scalar_t s = t.sin_c;
  for (int64_t z = 0; z < k.Z; ++z) {
    const scalar_t zeta = k.zeta[z];
    const scalar_t cdev = t.c * k.cos_z[z] + s * k.sin_z[z];
    const scalar_t base = (scalar_t(1) + cdev) / scalar_t(2);
    // d cos(acos(c) - ts)/dc and its derivative -sin(ts) / (1 - c^2)^(3/2).
    const scalar_t d1 = k.cos_z[z] - t.c / s * k.sin_z[z];
    const scalar_t pw1 = std::pow(base, zeta - scalar_t(1));
    f1[z] = scalar_t(2) * pw1 * base;
    df1[z] = zeta * pw1 * d1;
    if (d2f1) {
      const scalar_t d2 = -k.sin_z[z] / (s * s * s);
      d2f1[z] = zeta * (zeta - scalar_t(1)) / scalar_t(2) * std::pow(base, zeta - scalar_t(2)) *
                    d1 * d1 +
                zeta * pw1 * d2;
    }
  }
}

// f2_a(m) = exp(-eta_a (m - Rs_a)^2) and its first two derivatives in m.
template <typename scalar_t>
void distance_terms(const Consts<scalar_t>& k, scalar_t mean_r, scalar_t* f2, scalar_t* df2,
                    scalar_t* d2f2) {
  for (int64_t a = 0; a < k.A; ++a) {
    const scalar_t eta = k.eta_a[a];
    const scalar_t x = mean_r - k.shf_a[a];
    f2[a] = std::exp(-eta * x * x);
    df2[a] = scalar_t(-2) * eta * x * f2[a];
    if (d2f2) d2f2[a] = (scalar_t(4) * eta * eta * x * x - scalar_t(2) * eta) * f2[a];
  }
}

// phi(r) = sum_s g_s 0.25 exp(-eta_s (r - Rs_s)^2) fc(r): first and second derivatives.
template <typename scalar_t>
void radial_phi(const Consts<scalar_t>& k, scalar_t r, const scalar_t* g, scalar_t& phi1,
                scalar_t& phi2) {
  const scalar_t fc = cutoff_cos(r, k.rc_r);
  const scalar_t dfc = cutoff_cos_deriv(r, k.rc_r);
  const scalar_t d2fc = cutoff_cos_deriv2(r, k.rc_r);
  phi1 = 0;
  phi2 = 0;
  for (int64_t s = 0; s < k.R; ++s) {
    const scalar_t eta = k.eta_r[s];
    const scalar_t x = r - k.shf_r[s];
    const scalar_t e = scalar_t(0.25) * std::exp(-eta * x * x);
    const scalar_t de = scalar_t(-2) * eta * x * e;
    const scalar_t d2e = (scalar_t(4) * eta * eta * x * x - scalar_t(2) * eta) * e;
    phi1 += g[s] * (de * fc + e * dfc);
    phi2 += g[s] * (d2e * fc + scalar_t(2) * de * dfc + e * d2fc);
  }
}

// First and second derivatives of Psi(q, r1, r2) = sum_az g_az f1_z(0.95 q)
// f2_a((r1 + r2) / 2) fc(r1) fc(r2), the angular block of one triple contracted
// with g (q = cos_raw).
template <typename scalar_t>
struct PsiDerivs {
  scalar_t q, r1, r2, qq, q1, q2, r11, r22, r12;
};

// Per-thread scratch for the angular terms.
template <typename scalar_t>
struct AngularScratch {
  std::vector<scalar_t> f1, df1, d2f1, f2, df2, d2f2;
  explicit AngularScratch(const Consts<scalar_t>& k)
      : f1(k.Z), df1(k.Z), d2f1(k.Z), f2(k.A), df2(k.A), d2f2(k.A) {}
};

// fc*, dfc*, d2fc*: the angular cutoff and its derivatives at r1 and r2.
template <typename scalar_t>
PsiDerivs<scalar_t> psi_derivs(const Consts<scalar_t>& k, const Triple<scalar_t>& t,
                               const scalar_t* g, scalar_t fc1, scalar_t fc2, scalar_t dfc1,
                               scalar_t dfc2, scalar_t d2fc1, scalar_t d2fc2,
                               AngularScratch<scalar_t>& w) {
  angle_terms<scalar_t>(k, t, w.f1.data(), w.df1.data(), w.d2f1.data());
  distance_terms<scalar_t>(k, t.mean_r, w.f2.data(), w.df2.data(), w.d2f2.data());
  // S_mn = sum_az g_az f1^(m)_z f2^(n)_a: derivatives of the contracted block
  // with respect to c (m times) and to the mean distance (n times).
  scalar_t s00 = 0, s01 = 0, s02 = 0, s10 = 0, s11 = 0, s20 = 0;
  for (int64_t a = 0; a < k.A; ++a) {
    scalar_t r0 = 0, r1 = 0, r2 = 0;
    for (int64_t z = 0; z < k.Z; ++z) {
      const scalar_t gz = g[a * k.Z + z];
      r0 += gz * w.f1[z];
      r1 += gz * w.df1[z];
      r2 += gz * w.d2f1[z];
    }
    s00 += r0 * w.f2[a];
    s01 += r0 * w.df2[a];
    s02 += r0 * w.d2f2[a];
    s10 += r1 * w.f2[a];
    s11 += r1 * w.df2[a];
    s20 += r2 * w.f2[a];
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

// (o1, o2) += Hess_{v1,v2}(Psi) (u1, u2): the chain rule through q, r1, r2.
template <typename scalar_t>
void triple_hvp(const Neighbor<scalar_t>& n1, const Neighbor<scalar_t>& n2,
                const Triple<scalar_t>& t, const TripleGrad<scalar_t>& d,
                const PsiDerivs<scalar_t>& p, const scalar_t* u1, const scalar_t* u2,
                scalar_t* o1, scalar_t* o2) {
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
void radial_hvp(const Neighbor<scalar_t>& n, scalar_t phi1, scalar_t phi2, const scalar_t* u,
                scalar_t* o) {
  const scalar_t hu = dot3(n.v, u) / n.r;
  for (int c = 0; c < 3; ++c) {
    const scalar_t hc = n.v[c] / n.r;
    o[c] += phi2 * hu * hc + phi1 / n.r * (u[c] - hu * hc);
  }
}

// True where any half edge of `center` has a nonzero direction.
inline bool any_moving(const HalfEdges& h, int64_t center, const std::vector<char>& moving) {
  for (int64_t e = h.start[center]; e < h.start[center + 1]; ++e)
    if (moving[e]) return true;
  return false;
}

// J t: the directional derivative of every AEV row along the half-edge directions u.
template <typename scalar_t>
void jvp_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                const Consts<scalar_t>& k, int64_t num_atoms, const scalar_t* u_edge,
                const std::vector<char>& moving, scalar_t* out) {
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), df1(k.Z), f2(k.A), df2(k.A), fc_a, dfc_a;
    for (int64_t i = begin; i < end; ++i) {
      if (species[i] < 0 || !any_moving(h, i, moving)) continue;
      scalar_t* row = out + i * k.F;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        if (n.r <= k.rc_a) ang.push_back(n);
        if (!moving[n.edge] || !(n.r > 0)) continue;
        const scalar_t dr = dot3(n.v, u_edge + 3 * n.edge) / n.r;
        const scalar_t fc = cutoff_cos(n.r, k.rc_r);
        const scalar_t dfc = cutoff_cos_deriv(n.r, k.rc_r);
        scalar_t* o = row + n.species * k.R;
        for (int64_t s = 0; s < k.R; ++s) {
          const scalar_t x = n.r - k.shf_r[s];
          const scalar_t e = scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x);
          o[s] += dr * e * (dfc - scalar_t(2) * k.eta_r[s] * x * fc);
        }
      }
      const size_t na = ang.size();
      fc_a.resize(na);
      dfc_a.resize(na);
      for (size_t j = 0; j < na; ++j) {
        fc_a[j] = cutoff_cos(ang[j].r, k.rc_a);
        dfc_a[j] = cutoff_cos_deriv(ang[j].r, k.rc_a);
      }
      for (size_t j = 0; j < na; ++j) {
        for (size_t l = j + 1; l < na; ++l) {
          const auto& n1 = ang[j];
          const auto& n2 = ang[l];
          if (!moving[n1.edge] && !moving[n2.edge]) continue;
          const scalar_t* u1 = u_edge + 3 * n1.edge;
          const scalar_t* u2 = u_edge + 3 * n2.edge;
          const auto t = make_triple(n1, n2);
          const auto d = triple_grad(n1, n2, t);
          const scalar_t dq = dot3(d.gq1, u1) + dot3(d.gq2, u2);
          const scalar_t dr1 = dot3(d.h1, u1), dr2 = dot3(d.h2, u2);
          angle_terms<scalar_t>(k, t, f1.data(), df1.data(), nullptr);
          distance_terms<scalar_t>(k, t.mean_r, f2.data(), df2.data(), nullptr);
          const scalar_t fcc = fc_a[j] * fc_a[l];
          const scalar_t dfcc = dfc_a[j] * fc_a[l] * dr1 + fc_a[j] * dfc_a[l] * dr2;
          const scalar_t cq = scalar_t(0.95) * dq * fcc;
          const scalar_t cm = scalar_t(0.5) * (dr1 + dr2) * fcc;
          scalar_t* o = row + k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z;
          for (int64_t a = 0; a < k.A; ++a) {
            const scalar_t pa = cq * f2[a];
            const scalar_t qa = cm * df2[a] + dfcc * f2[a];
            for (int64_t z = 0; z < k.Z; ++z) o[a * k.Z + z] += pa * df1[z] + qa * f1[z];
          }
        }
      }
    }
  });
}

// (sum_f g_f Hess(aev_f)) u, per half edge (the gradient with respect to v_e).
template <typename scalar_t>
void hvp_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                const Consts<scalar_t>& k, int64_t num_atoms, const scalar_t* grad_aev,
                const scalar_t* u_edge, const std::vector<char>& moving, scalar_t* out_edge) {
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> fc_a, dfc_a, d2fc_a;
    AngularScratch<scalar_t> w(k);
    for (int64_t i = begin; i < end; ++i) {
      if (species[i] < 0 || !any_moving(h, i, moving)) continue;
      const scalar_t* grow = grad_aev + i * k.F;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        if (n.r <= k.rc_a) ang.push_back(n);
        if (!moving[n.edge] || !(n.r > 0)) continue;
        scalar_t phi1, phi2;
        radial_phi(k, n.r, grow + n.species * k.R, phi1, phi2);
        radial_hvp(n, phi1, phi2, u_edge + 3 * n.edge, out_edge + 3 * n.edge);
      }
      const size_t na = ang.size();
      fc_a.resize(na);
      dfc_a.resize(na);
      d2fc_a.resize(na);
      for (size_t j = 0; j < na; ++j) {
        fc_a[j] = cutoff_cos(ang[j].r, k.rc_a);
        dfc_a[j] = cutoff_cos_deriv(ang[j].r, k.rc_a);
        d2fc_a[j] = cutoff_cos_deriv2(ang[j].r, k.rc_a);
      }
      for (size_t j = 0; j < na; ++j) {
        for (size_t l = j + 1; l < na; ++l) {
          const auto& n1 = ang[j];
          const auto& n2 = ang[l];
          if (!moving[n1.edge] && !moving[n2.edge]) continue;
          const auto t = make_triple(n1, n2);
          const scalar_t* g =
              grow + k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z;
          const auto p = psi_derivs(k, t, g, fc_a[j], fc_a[l], dfc_a[j], dfc_a[l], d2fc_a[j],
                                    d2fc_a[l], w);
          const auto d = triple_grad(n1, n2, t);
          triple_hvp(n1, n2, t, d, p, u_edge + 3 * n1.edge, u_edge + 3 * n2.edge,
                     out_edge + 3 * n1.edge, out_edge + 3 * n2.edge);
        }
      }
    }
  });
}

// Slots of the atoms each centre depends on: slot 0 is the centre itself, then
// its distinct neighbour atoms in order of first appearance (a neighbour seen
// through several periodic images, or the centre's own image, shares a slot).
struct LocalSlots {
  std::vector<int64_t> slot;  // (E,) slot of the neighbour of each half edge
  std::vector<int64_t> atom;  // (N * max_slots,) atom of each slot, -1 where unused
  int64_t max_slots = 1;
};

inline LocalSlots local_slots(const HalfEdges& h, const int64_t* species, int64_t num_atoms) {
  LocalSlots ls;
  ls.slot.assign(h.pair.size(), 0);
  std::vector<int64_t> count(num_atoms, 1);
  std::vector<int64_t> seen(num_atoms, -1), seen_slot(num_atoms, 0);
  for (int64_t i = 0; i < num_atoms; ++i) {
    if (species[i] < 0) continue;
    for (int64_t e = h.start[i]; e < h.start[i + 1]; ++e) {
      const int64_t o = h.other[e];
      if (o == i) continue;  // slot 0
      if (seen[o] != i) {
        seen[o] = i;
        seen_slot[o] = count[i]++;
      }
      ls.slot[e] = seen_slot[o];
    }
    ls.max_slots = std::max(ls.max_slots, count[i]);
  }
  const int64_t K = ls.max_slots;
  ls.atom.assign(num_atoms * K, -1);
  for (int64_t i = 0; i < num_atoms; ++i) {
    if (species[i] < 0) continue;
    ls.atom[i * K] = i;
    for (int64_t e = h.start[i]; e < h.start[i + 1]; ++e) ls.atom[i * K + ls.slot[e]] = h.other[e];
  }
  return ls;
}

// For every centre i, in the slots' coordinates x_s (v_e = x_nbr(e) - x_i + shift):
//   jac[i, s, c, f']        = d aev_if / d x_{s,c}, f = columns[f']
//   curv[i, s, c, s', c']   = sum_f g_if d2 aev_if / d x_{s,c} d x_{s',c'}
// An edge-space block B (edges e, e') lands on the slots (nbr, nbr') with +B,
// (0, 0) with +B and (nbr, 0), (0, nbr') with -B.
template <typename scalar_t>
void local_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                  const Consts<scalar_t>& k, int64_t num_atoms, const scalar_t* grad_aev,
                  const LocalSlots& ls, const std::vector<int64_t>& colmap, int64_t C,
                  scalar_t* jac, scalar_t* curv) {
  // colmap: AEV column -> column of jac, or -1 for columns not asked for.
  const int64_t K = ls.max_slots, F = k.F, K3 = 3 * K;
  at::parallel_for(0, num_atoms, 4, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> fc_a, dfc_a, d2fc_a;
    AngularScratch<scalar_t> w(k);
    for (int64_t i = begin; i < end; ++i) {
      if (species[i] < 0) continue;
      const scalar_t* grow = grad_aev + i * F;
      scalar_t* J = jac + i * K3 * C;
      scalar_t* Hc = curv + i * K3 * K3;
      auto block = [&](int64_t sa, int64_t sb, const scalar_t (&B)[3][3]) {
        for (int c = 0; c < 3; ++c)
          for (int d = 0; d < 3; ++d) {
            const scalar_t v = B[c][d];
            Hc[(3 * sa + c) * K3 + 3 * sb + d] += v;
            Hc[c * K3 + d] += v;
            Hc[(3 * sa + c) * K3 + d] -= v;
            Hc[c * K3 + 3 * sb + d] -= v;
          }
      };
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        if (n.r <= k.rc_a) ang.push_back(n);
        if (!(n.r > 0)) continue;
        const int64_t sl = ls.slot[n.edge];
        const scalar_t fc = cutoff_cos(n.r, k.rc_r);
        const scalar_t dfc = cutoff_cos_deriv(n.r, k.rc_r);
        scalar_t hv[3];
        for (int c = 0; c < 3; ++c) hv[c] = n.v[c] / n.r;
        const int64_t off = n.species * k.R;
        for (int64_t s = 0; s < k.R; ++s) {
          const int64_t col = colmap[off + s];
          if (col < 0) continue;
          const scalar_t x = n.r - k.shf_r[s];
          const scalar_t e = scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x);
          const scalar_t dr = e * (dfc - scalar_t(2) * k.eta_r[s] * x * fc);
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
        block(sl, sl, B);
      }
      const size_t na = ang.size();
      fc_a.resize(na);
      dfc_a.resize(na);
      d2fc_a.resize(na);
      for (size_t j = 0; j < na; ++j) {
        fc_a[j] = cutoff_cos(ang[j].r, k.rc_a);
        dfc_a[j] = cutoff_cos_deriv(ang[j].r, k.rc_a);
        d2fc_a[j] = cutoff_cos_deriv2(ang[j].r, k.rc_a);
      }
      for (size_t j = 0; j < na; ++j) {
        for (size_t l = j + 1; l < na; ++l) {
          const auto& n1 = ang[j];
          const auto& n2 = ang[l];
          const int64_t s1 = ls.slot[n1.edge], s2 = ls.slot[n2.edge];
          const auto t = make_triple(n1, n2);
          const auto d = triple_grad(n1, n2, t);
          const int64_t off =
              k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z;
          // Also leaves f1, df1, f2, df2 of this triple in w.
          const auto p = psi_derivs(k, t, grow + off, fc_a[j], fc_a[l], dfc_a[j], dfc_a[l],
                                    d2fc_a[j], d2fc_a[l], w);
          const scalar_t fcc = fc_a[j] * fc_a[l];
          const scalar_t dc1 = dfc_a[j] * fc_a[l], dc2 = fc_a[j] * dfc_a[l];
          for (int64_t a = 0; a < k.A; ++a) {
            const scalar_t cq_a = scalar_t(0.95) * w.f2[a] * fcc;
            const scalar_t m_a = scalar_t(0.5) * w.df2[a] * fcc;
            const scalar_t r1_a = m_a + w.f2[a] * dc1, r2_a = m_a + w.f2[a] * dc2;
            for (int64_t z = 0; z < k.Z; ++z) {
              const int64_t col = colmap[off + a * k.Z + z];
              if (col < 0) continue;
              const scalar_t cq = cq_a * w.df1[z], cr1 = r1_a * w.f1[z], cr2 = r2_a * w.f1[z];
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
          block(s1, s1, B11);
          block(s1, s2, B12);
          block(s2, s1, B21);
          block(s2, s2, B22);
        }
      }
    }
  });
}

// Pair directions (P, 3) -> half-edge directions in each owner's frame (the
// vector to the neighbour is -diff for the edge owned by i0, +diff for i1).
template <typename scalar_t>
void edge_directions(const HalfEdges& h, const scalar_t* t, int64_t num_pairs,
                     std::vector<scalar_t>& u, std::vector<char>& moving) {
  const int64_t E = static_cast<int64_t>(h.pair.size());
  u.assign(3 * E, scalar_t(0));
  moving.assign(E, 0);
  at::parallel_for(0, num_pairs, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t e0 = h.edge0[q], e1 = h.edge1[q];
      if (e0 < 0) continue;
      const scalar_t* tq = t + 3 * q;
      const bool m = tq[0] != 0 || tq[1] != 0 || tq[2] != 0;
      moving[e0] = moving[e1] = m;
      for (int c = 0; c < 3; ++c) {
        u[3 * e0 + c] = -tq[c];
        u[3 * e1 + c] = tq[c];
      }
    }
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
  check_aev_inputs(op, species, pairs, diff_vectors, p);
  check_tangent(op, tangent, diff_vectors);
  auto sp = species_checked(op, species, p.num_species);
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto t = tangent.to(diff.scalar_type()).contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  std::vector<int64_t> out_shape(species.sizes().begin(), species.sizes().end());
  out_shape.push_back(aev_length(p));
  auto out = at::zeros(out_shape, diff.options());
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_jvp_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = build_half_edges(sp.data_ptr<int64_t>(), N, pr.data_ptr<int64_t>(),
                              pr.data_ptr<int64_t>() + P, diff.data_ptr<scalar_t>(), P,
                              p.radial_cutoff);
    std::vector<scalar_t> u;
    std::vector<char> moving;
    edge_directions(h, t.data_ptr<scalar_t>(), P, u, moving);
    jvp_kernel(sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>(), h, k, N, u.data(), moving,
               out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor aev_double_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                   const at::Tensor& species, const at::Tensor& pairs,
                                   const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_double_backward";
  check_aev_inputs(op, species, pairs, diff_vectors, p);
  check_tangent(op, tangent, diff_vectors);
  TORCH_CHECK(grad_aev.numel() == species.numel() * aev_length(p), op,
              ": grad_aev must have shape species.shape + (", aev_length(p), ",), got ",
              grad_aev.sizes());
  auto sp = species_checked(op, species, p.num_species);
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto g = grad_aev.to(diff.scalar_type()).contiguous();
  auto t = tangent.to(diff.scalar_type()).contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  auto out = at::zeros({P, 3}, diff.options());
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_double_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = build_half_edges(sp.data_ptr<int64_t>(), N, pr.data_ptr<int64_t>(),
                              pr.data_ptr<int64_t>() + P, diff.data_ptr<scalar_t>(), P,
                              p.radial_cutoff);
    std::vector<scalar_t> u;
    std::vector<char> moving;
    edge_directions(h, t.data_ptr<scalar_t>(), P, u, moving);
    std::vector<scalar_t> out_edge(u.size(), scalar_t(0));
    hvp_kernel(sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>(), h, k, N, g.data_ptr<scalar_t>(),
               u.data(), moving, out_edge.data());
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, P, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t e0 = h.edge0[q], e1 = h.edge1[q];
        if (e0 < 0) continue;
        for (int c = 0; c < 3; ++c) o[3 * q + c] = out_edge[3 * e1 + c] - out_edge[3 * e0 + c];
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cpu(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_local_derivatives";
  check_aev_inputs(op, species, pairs, diff_vectors, p);
  TORCH_CHECK(grad_aev.numel() == species.numel() * aev_length(p), op,
              ": grad_aev must have shape species.shape + (", aev_length(p), ",), got ",
              grad_aev.sizes());
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
  auto sp = species_checked(op, species, p.num_species);
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto g = grad_aev.to(diff.scalar_type()).contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  at::Tensor local_atoms, jac, curv;
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_local_derivatives_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = build_half_edges(sp.data_ptr<int64_t>(), N, pr.data_ptr<int64_t>(),
                              pr.data_ptr<int64_t>() + P, diff.data_ptr<scalar_t>(), P,
                              p.radial_cutoff);
    const auto ls = local_slots(h, sp.data_ptr<int64_t>(), N);
    const int64_t K = ls.max_slots;
    local_atoms = at::from_blob(const_cast<int64_t*>(ls.atom.data()), {N, K},
                                at::TensorOptions().dtype(at::kLong))
                      .clone();
    jac = at::zeros({N, K, 3, C}, diff.options());
    curv = at::zeros({N, K, 3, K, 3}, diff.options());
    local_kernel(sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>(), h, k, N,
                 g.data_ptr<scalar_t>(), ls, colmap, C, jac.data_ptr<scalar_t>(),
                 curv.data_ptr<scalar_t>());
  });
  return {local_atoms, jac, curv};
}

}  // namespace torchani_fast
