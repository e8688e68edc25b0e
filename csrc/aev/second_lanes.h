// The vectorised second derivatives of the AEV (aev_math::jvp_center and
// hvp_center on lanes): one source for float32 on 8 lanes (AVX2) and float64
// on 4 (AVX2) or 8 (AVX-512). Included by aev/second_cpu.cpp once per width,
// inside a namespace that defines the lane type vd, the scalar S, kLanes, the
// operations ld, st, bc, add, sub, mul, div, fma (a b + c), fnma (c - a b),
// fms (a b - c), zero, hsum and gather(base, offsets, extra) (base[offsets[j]
// + extra] in lane j), and TF_LANE_FN / TF_LANE_INLINE (the width's target).
//
// The radial terms of one neighbour kLanes shifts at a time (the Terms policy
// of aev_math::jvp_radial_center / hvp_radial_center); the angular terms
// kLanes triples at a time, their inputs packed lane by lane (TripleLanes),
// their results added to the centre's row or half edges triple by triple in
// the scalar code's order. The formulas are aev_math's (angle_terms,
// distance_terms, psi_contract, triple_grad, triple_hvp, jvp_triple), the
// divisions by r as products with 1 / r, the exps and logs simd::'s (within 2
// ulp; the scalar path calls libm); a clamped triple (r1 r2 < 1e-10) takes
// the scalar functions. The per-centre work does not depend on the thread, so
// the results are the same for any thread count.

// Scratch of one thread's centres.
struct TermScratch {
  std::vector<Neighbor<S>> neighbors;
  std::vector<S> block;  // jvp_lanes's A Z rows of kLanes lanes
};

// For the radial shifts s .. s + kLanes at distance r (rr): their eta, x = r - Rs
// and 0.25 exp(-eta x^2).
TF_LANE_INLINE vd radial_gauss(const ConstView<S>& k, vd rr, int64_t s, vd& eta, vd& x) {
  eta = ld(k.eta_r + s);
  x = sub(rr, ld(k.shf_r + s));
  const vd u = mul(mul(sub(zero(), eta), x), x);
  return mul(bc(S(0.25)), simd::exp(u));
}

// o[s] += dr d rad_s / dr (aev_math::radial_jvp).
TF_LANE_FN void radial_jvp_lanes(const ConstView<S>& k, S r, S fc, S dfc, S dr, S* o) {
  const vd rr = bc(r), vfc = bc(fc), vdfc = bc(dfc);
  const vd vdr = bc(dr);
  int64_t s = 0;
  for (; s + kLanes <= k.R; s += kLanes) {
    vd eta, x;
    const vd ex = radial_gauss(k, rr, s, eta, x);
    const vd slope = fnma(mul(add(eta, eta), x), vfc, vdfc);
    st(o + s, fma(mul(vdr, ex), slope, ld(o + s)));
  }
  if (s < k.R) aev_math::radial_jvp(k, r, fc, dfc, dr, o, s);  // shifts past the last vector
}

// aev_math::radial_phi.
TF_LANE_FN void radial_phi_lanes(const ConstView<S>& k, S r, const S* g, S& phi1, S& phi2) {
  const S fc = aev_math::cutoff_value(k.cut, r, k.rc_r);
  const S dfc = aev_math::cutoff_deriv(k.cut, r, k.rc_r);
  const S d2fc = aev_math::cutoff_deriv2(k.cut, r, k.rc_r);
  const vd rr = bc(r), vfc = bc(fc), vdfc = bc(dfc);
  const vd vd2fc = bc(d2fc);
  vd acc1 = zero(), acc2 = zero();
  int64_t s = 0;
  for (; s + kLanes <= k.R; s += kLanes) {
    vd eta, x;
    const vd e = radial_gauss(k, rr, s, eta, x);
    const vd two_eta_x = mul(add(eta, eta), x);
    const vd de = sub(zero(), mul(two_eta_x, e));
    const vd d2e = mul(fms(two_eta_x, two_eta_x, add(eta, eta)), e);  // (4 eta^2 x^2 - 2 eta) e
    const vd gs = ld(g + s);
    acc1 = fma(gs, fma(de, vfc, mul(e, vdfc)), acc1);
    const vd two_de_dfc = mul(add(de, de), vdfc);
    acc2 = fma(gs, fma(d2e, vfc, fma(e, vd2fc, two_de_dfc)), acc2);
  }
  phi1 = hsum(acc1);
  phi2 = hsum(acc2);
  if (s < k.R) aev_math::radial_phi_sums(k, r, g, fc, dfc, d2fc, s, phi1, phi2);  // the rest
}

// The parts of kLanes triples that every section's terms use.
struct SectionParts {
  vd c, s, c_over_s, inv_s3;
};
TF_LANE_INLINE SectionParts section_parts(vd c, vd s) {
  const vd one = bc(S(1.0));
  return {c, s, div(c, s), div(one, mul(mul(s, s), s))};
}

// aev_math::angle_terms of section z for kLanes triples: f1, df1 and (second) d2f1.
TF_LANE_INLINE void section_terms(const ConstView<S>& k, int64_t z, const SectionParts& t,
                                 bool second, vd& f1, vd& df1, vd& d2f1) {
  const vd one = bc(S(1.0)), half = bc(S(0.5));
  const S zeta = k.zeta[z];
  const vd cos_z = bc(k.cos_z[z]), sin_z = bc(k.sin_z[z]);
  const vd cdev = fma(t.c, cos_z, mul(t.s, sin_z));
  const vd base = mul(add(one, cdev), half);
  const vd ln = simd::log(base);
  const vd d1 = fnma(t.c_over_s, sin_z, cos_z);
  const bool from_pw2 = second && zeta >= S(2.0);
  const vd pw2 = second ? simd::exp(mul(bc(zeta - S(2.0)), ln)) : zero();
  const vd pw1 = from_pw2 ? mul(pw2, base) : simd::exp(mul(bc(zeta - S(1.0)), ln));
  const vd zeta_pw1 = mul(bc(zeta), pw1);
  f1 = mul(mul(bc(S(2.0)), pw1), base);
  df1 = mul(zeta_pw1, d1);
  if (second) {
    const vd d2 = sub(zero(), mul(sin_z, t.inv_s3));
    const vd curv = mul(bc(zeta * (zeta - S(1.0)) / S(2.0)), mul(mul(pw2, d1), d1));
    d2f1 = fma(zeta_pw1, d2, curv);
  }
}

// aev_math::distance_terms of shift a for kLanes mean distances m: f2, df2 and
// (second) d2f2.
TF_LANE_INLINE void shift_terms(const ConstView<S>& k, int64_t a, vd m, bool second, vd& f2,
                               vd& df2, vd& d2f2) {
  const vd eta = bc(k.eta_a[a]);
  const vd x = sub(m, bc(k.shf_a[a]));
  f2 = simd::exp(mul(mul(sub(zero(), eta), x), x));
  const vd two_eta_x = mul(add(eta, eta), x);
  df2 = sub(zero(), mul(two_eta_x, f2));
  if (second) d2f2 = mul(fms(two_eta_x, two_eta_x, add(eta, eta)), f2);
}

// The most angular shifts (A) and sections (Z) of the angular lane kernels.
constexpr int64_t kMaxAngular = 16;

// The inputs of kLanes triples of jvp_lanes and hvp_lanes, one row of lanes per
// field (the half edges' vectors, tangents, 1 / r and angular cutoffs, the
// triple's c, sin_c, mean distance and cos).
enum TripleField {
  kX1, kY1, kZ1, kX2, kY2, kZ2, kU1x, kU1y, kU1z, kU2x, kU2y, kU2z,
  kInv1, kInv2, kFc1, kFc2, kDfc1, kDfc2, kD2fc1, kD2fc2, kC, kS, kM, kQ, kTripleFields
};

TF_LANE_INLINE vd dot3(const vd (&x)[3], const vd (&y)[3]) {
  return fma(x[2], y[2], fma(x[1], y[1], mul(x[0], y[0])));
}

// The geometry of kLanes triples: h = v / r, gq = dq/dv (not clamped), u.
struct Geometry {
  vd h1[3], h2[3], gq1[3], gq2[3], u1[3], u2[3];
};
TF_LANE_INLINE Geometry geometry(const S (&in)[kTripleFields][kLanes]) {
  Geometry g;
  const vd inv1 = ld(in[kInv1]), inv2 = ld(in[kInv2]);
  const vd q = ld(in[kQ]);
  for (int c = 0; c < 3; ++c) {
    g.h1[c] = mul(ld(in[kX1 + c]), inv1);
    g.h2[c] = mul(ld(in[kX2 + c]), inv2);
    g.u1[c] = ld(in[kU1x + c]);
    g.u2[c] = ld(in[kU2x + c]);
  }
  for (int c = 0; c < 3; ++c) {
    g.gq1[c] = mul(fnma(q, g.h1[c], g.h2[c]), inv1);
    g.gq2[c] = mul(fnma(q, g.h2[c], g.h1[c]), inv2);
  }
  return g;
}

// aev_math::jvp_triple of kLanes triples: out[kLanes (a Z + z) + lane], the
// directional derivative of each triple's angular block along its u.
TF_LANE_FN void jvp_lanes(const ConstView<S>& k, const S (&in)[kTripleFields][kLanes], S* out) {
  const int64_t Z = k.Z, A = k.A;
  const Geometry g = geometry(in);
  const vd dq = add(dot3(g.gq1, g.u1), dot3(g.gq2, g.u2));
  const vd dr1 = dot3(g.h1, g.u1), dr2 = dot3(g.h2, g.u2);
  const vd fc1 = ld(in[kFc1]), fc2 = ld(in[kFc2]);
  const vd fcc = mul(fc1, fc2);
  const vd dfc1 = ld(in[kDfc1]), dfc2 = ld(in[kDfc2]);
  const vd dfcc = fma(mul(fc1, dfc2), dr2, mul(mul(dfc1, fc2), dr1));
  const vd cq = mul(mul(bc(S(0.95)), dq), fcc);
  const vd cm = mul(mul(bc(S(0.5)), add(dr1, dr2)), fcc);
  const SectionParts t = section_parts(ld(in[kC]), ld(in[kS]));
  vd f1[kMaxAngular], df1[kMaxAngular], unused;
  for (int64_t z = 0; z < Z; ++z) section_terms(k, z, t, /*second=*/false, f1[z], df1[z], unused);
  const vd m = ld(in[kM]);
  for (int64_t a = 0; a < A; ++a) {
    vd f2, df2;
    shift_terms(k, a, m, /*second=*/false, f2, df2, unused);
    const vd pa = mul(cq, f2);
    const vd qa = fma(dfcc, f2, mul(cm, df2));
    for (int64_t z = 0; z < Z; ++z)
      st(out + kLanes * (a * Z + z), fma(qa, f1[z], mul(pa, df1[z])));
  }
}

// The angular Hessian-vector product of kLanes triples (hvp_angular_lanes'
// lanes): out[0..3) the gradient of the first half edge of each, out[3..6) the
// second's.
TF_LANE_FN void hvp_lanes(const ConstView<S>& k, const S* grow,
                          const S (&in)[kTripleFields][kLanes], const int32_t (&goff)[kLanes],
                          S (&out)[6][kLanes]) {
  const int64_t Z = k.Z, A = k.A;
  const SectionParts t = section_parts(ld(in[kC]), ld(in[kS]));
  // The distance terms of every shift, then per section its terms and the
  // contractions over the shifts (t0, t1, t2: with f2, df2, d2f2).
  vd f2[kMaxAngular], df2[kMaxAngular], d2f2[kMaxAngular];
  const vd m = ld(in[kM]);
  for (int64_t a = 0; a < A; ++a) shift_terms(k, a, m, /*second=*/true, f2[a], df2[a], d2f2[a]);
  vd s00 = zero(), s01 = s00, s02 = s00, s10 = s00, s11 = s00, s20 = s00;
  for (int64_t z = 0; z < Z; ++z) {
    vd f1, df1, d2f1;
    section_terms(k, z, t, /*second=*/true, f1, df1, d2f1);
    vd t0 = zero(), t1 = t0, t2 = t0;
    for (int64_t a = 0; a < A; ++a) {
      const vd g = gather(grow, goff, static_cast<int32_t>(a * Z + z));
      t0 = fma(g, f2[a], t0);
      t1 = fma(g, df2[a], t1);
      t2 = fma(g, d2f2[a], t2);
    }
    s00 = fma(f1, t0, s00);
    s01 = fma(f1, t1, s01);
    s02 = fma(f1, t2, s02);
    s10 = fma(df1, t0, s10);
    s11 = fma(df1, t1, s11);
    s20 = fma(d2f1, t0, s20);
  }
  // aev_math::psi_contract's derivatives of Psi from the sums.
  const vd fc1 = ld(in[kFc1]), fc2 = ld(in[kFc2]);
  const vd dfc1 = ld(in[kDfc1]), dfc2 = ld(in[kDfc2]);
  const vd C = mul(fc1, fc2), k95 = bc(S(0.95));
  const vd half = bc(S(0.5)), quarter = bc(S(0.25));
  const vd d1c = mul(dfc1, fc2), d2c = mul(fc1, dfc2);
  const vd half_C_s01 = mul(mul(half, C), s01);
  const vd half_C_s11 = mul(mul(half, C), s11);
  const vd quarter_C_s02 = mul(mul(quarter, C), s02);
  const vd p_q = mul(mul(k95, C), s10);
  const vd p_r1 = fma(d1c, s00, half_C_s01);
  const vd p_r2 = fma(d2c, s00, half_C_s01);
  const vd p_qq = mul(mul(mul(k95, k95), C), s20);
  const vd p_q1 = mul(k95, fma(d1c, s10, half_C_s11));
  const vd p_q2 = mul(k95, fma(d2c, s10, half_C_s11));
  const vd p_r11 = fma(mul(ld(in[kD2fc1]), fc2), s00, fma(d1c, s01, quarter_C_s02));
  const vd p_r22 = fma(mul(fc1, ld(in[kD2fc2])), s00, fma(d2c, s01, quarter_C_s02));
  const vd p_r12 =
      fma(mul(dfc1, dfc2), s00, fma(mul(half, add(d1c, d2c)), s01, quarter_C_s02));
  // aev_math::triple_grad and triple_hvp (not clamped).
  const Geometry geo = geometry(in);
  const vd inv1 = ld(in[kInv1]), inv2 = ld(in[kInv2]), q = ld(in[kQ]);
  const auto &h1 = geo.h1, &h2 = geo.h2, &gq1 = geo.gq1, &gq2 = geo.gq2, &u1 = geo.u1, &u2 = geo.u2;
  const vd dq = add(dot3(gq1, u1), dot3(gq2, u2));
  const vd a1 = dot3(h1, u1), b1 = dot3(h2, u1), a2 = dot3(h1, u2), b2 = dot3(h2, u2);
  const vd c_q = fma(p_q2, b2, fma(p_q1, a1, mul(p_qq, dq)));
  const vd c_1 = fma(p_r12, b2, fma(p_r11, a1, mul(p_q1, dq)));
  const vd c_2 = fma(p_r22, b2, fma(p_r12, a1, mul(p_q2, dq)));
  const vd i11 = mul(inv1, inv1), i22 = mul(inv2, inv2);
  const vd i12 = mul(inv1, inv2), three_q = mul(bc(S(3.0)), q);
  const vd qa1 = mul(q, a1), qb2 = mul(q, b2);
  const vd qa1_3 = mul(three_q, a1), qb2_3 = mul(three_q, b2);
  for (int c = 0; c < 3; ++c) {
    const vd x1 = h1[c], x2 = h2[c];
    // hq1 = (-a1 x2 - b1 x1 + 3 q a1 x1 - q u1) i11 + (u2 - b2 x2 - a2 x1 + q b2 x1) i12
    const vd p11 = fnma(q, u1[c], fms(qa1_3, x1, fma(a1, x2, mul(b1, x1))));
    const vd p12 = fma(qb2, x1, sub(u2[c], fma(b2, x2, mul(a2, x1))));
    const vd hq1 = fma(p11, i11, mul(p12, i12));
    // hq2 = (u1 - b1 x2 - a1 x1 + q a1 x2) i12 + (-b2 x1 - a2 x2 + 3 q b2 x2 - q u2) i22
    const vd p21 = fma(qa1, x2, sub(u1[c], fma(b1, x2, mul(a1, x1))));
    const vd p22 = fnma(q, u2[c], fms(qb2_3, x2, fma(b2, x1, mul(a2, x2))));
    const vd hq2 = fma(p21, i12, mul(p22, i22));
    const vd hr1 = mul(fnma(a1, x1, u1[c]), inv1);
    const vd hr2 = mul(fnma(b2, x2, u2[c]), inv2);
    const vd o1 = fma(p_r1, hr1, fma(p_q, hq1, fma(c_1, x1, mul(c_q, gq1[c]))));
    const vd o2 = fma(p_r2, hr2, fma(p_q, hq2, fma(c_2, x2, mul(c_q, gq2[c]))));
    st(out[c], o1);
    st(out[3 + c], o2);
  }
}

// The inputs of up to kLanes triples of one centre, one row of lanes per field;
// n of them used.
struct TripleLanes {
  alignas(64) S in[kTripleFields][kLanes];
  alignas(64) int32_t goff[kLanes];       // the triple's angular block in the AEV row
  int64_t first[kLanes], second[kLanes];  // its neighbours in TermScratch::neighbors
  bool clamped[kLanes];                   // r1 r2 < 1e-10: the scalar functions' triple
  int64_t n = 0;

  // The unused lanes made benign (unit vectors, no cutoff), for run(lanes).
  void pad() {
    for (int64_t j = n; j < kLanes; ++j) {
      for (int f = 0; f < kTripleFields; ++f) in[f][j] = S(0.0);
      in[kX1][j] = in[kY2][j] = in[kInv1][j] = in[kInv2][j] = in[kS][j] = S(1.0);
      goff[j] = goff[0];
    }
  }
};

// For the triples of centre i that jvp_center and hvp_center visit, in their
// order, kLanes at a time: run(lanes) on their packed inputs (with the angular
// cutoffs in fcw, aev_math::angular_cutoffs). sc.neighbors: the centre's.
template <typename Run>
void for_triples(const ConstView<S>& k, const HalfEdgeView<S>& h, int64_t i, const S* u_edge,
                 const uint8_t* moving, bool second, S* fcw, TermScratch& sc, const Run& run) {
  const int64_t begin = h.begin(i), count = h.end(i) - begin;
  aev_math::angular_cutoffs(k, h, i, second, fcw);
  sc.neighbors.resize(count);
  for (int64_t e = 0; e < count; ++e) sc.neighbors[e] = h.neighbor(begin + e);
  TripleLanes lanes;
  for (int64_t j1 = 0; j1 < count; ++j1) {
    const Neighbor<S>& n1 = sc.neighbors[j1];
    if (!(n1.r <= k.rc_a)) continue;
    for (int64_t j2 = j1 + 1; j2 < count; ++j2) {
      const Neighbor<S>& n2 = sc.neighbors[j2];
      if (!aev_math::visits_triple(k, n1.r, n2.r, moving, n1.edge, n2.edge)) continue;
      const Triple<S> t = make_triple(n1, n2);
      const int64_t e1 = n1.edge, e2 = n2.edge;
      const S* u1 = u_edge + 3 * e1;
      const S* u2 = u_edge + 3 * e2;
      const S vals[kTripleFields] = {
          n1.v[0], n1.v[1], n1.v[2], n2.v[0], n2.v[1], n2.v[2], u1[0], u1[1], u1[2],
          u2[0], u2[1], u2[2], n1.r > 0 ? S(1.0) / n1.r : S(0.0), n2.r > 0 ? S(1.0) / n2.r : S(0.0),
          fcw[3 * e1], fcw[3 * e2], fcw[3 * e1 + 1], fcw[3 * e2 + 1],
          second ? fcw[3 * e1 + 2] : S(0.0), second ? fcw[3 * e2 + 2] : S(0.0),
          t.clamped ? S(0.0) : t.c, t.clamped ? S(1.0) : t.sin_c, t.mean_r,
          t.clamped ? S(0.0) : t.cos_raw};
      const int64_t n = lanes.n;
      for (int f = 0; f < kTripleFields; ++f) lanes.in[f][n] = vals[f];
      lanes.goff[n] =
          static_cast<int32_t>(k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z);
      lanes.first[n] = j1;
      lanes.second[n] = j2;
      lanes.clamped[n] = t.clamped;
      if (++lanes.n == kLanes) {
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

// aev_math::hvp_angular_center on kLanes lanes (w: angular_scratch_len scalars).
void hvp_angular_lanes(const ConstView<S>& k, const HalfEdgeView<S>& h, int64_t i,
                       const S* grow, const S* u_edge, const uint8_t* moving, S* w, S* fcw,
                       S* out_edge, TermScratch& sc) {
  alignas(64) S out[6][kLanes];
  for_triples(k, h, i, u_edge, moving, /*second=*/true, fcw, sc, [&](const TripleLanes& l) {
    hvp_lanes(k, grow, l.in, l.goff, out);
    for (int64_t j = 0; j < l.n; ++j) {
      const Neighbor<S>& n1 = sc.neighbors[l.first[j]];
      const Neighbor<S>& n2 = sc.neighbors[l.second[j]];
      if (l.clamped[j]) {
        const Triple<S> t = make_triple(n1, n2);
        aev_math::angular_terms(k, t, /*second=*/true, w);
        aev_math::hvp_triple(n1, n2, t, aev_math::triple_psi(k, n1, n2, grow, fcw, w), u_edge,
                             out_edge);
        continue;
      }
      S* o1 = out_edge + 3 * n1.edge;
      S* o2 = out_edge + 3 * n2.edge;
      for (int c = 0; c < 3; ++c) {
        o1[c] += out[c][j];
        o2[c] += out[3 + c][j];
      }
    }
  });
}

// aev_math::jvp_angular_center on kLanes lanes (w: angular_scratch_len scalars).
void jvp_angular_lanes(const ConstView<S>& k, const HalfEdgeView<S>& h, int64_t i,
                       const S* u_edge, const uint8_t* moving, S* w, S* fcw, S* row,
                       TermScratch& sc) {
  const int64_t block = k.A * k.Z;
  sc.block.resize(kLanes * block);
  S* out = sc.block.data();
  for_triples(k, h, i, u_edge, moving, /*second=*/false, fcw, sc, [&](const TripleLanes& l) {
    jvp_lanes(k, l.in, out);
    for (int64_t j = 0; j < l.n; ++j) {
      if (l.clamped[j]) {
        const Neighbor<S>& n1 = sc.neighbors[l.first[j]];
        const Neighbor<S>& n2 = sc.neighbors[l.second[j]];
        const Triple<S> t = make_triple(n1, n2);
        aev_math::angular_terms(k, t, /*second=*/false, w);
        aev_math::jvp_triple(k, n1, n2, t, u_edge, fcw, w, row);
        continue;
      }
      S* o = row + l.goff[j];
      for (int64_t q = 0; q < block; ++q) o[q] += out[kLanes * q + j];
    }
  });
}

// The aev_math Terms policy of this lane width (its members as ScalarTerms').
struct VectorTerms {
  TermScratch* w;

  void radial_jvp(const ConstView<S>& k, S r, S fc, S dfc, S dr, S* o) const {
    radial_jvp_lanes(k, r, fc, dfc, dr, o);
  }
  void radial_phi(const ConstView<S>& k, S r, const S* g, S& phi1, S& phi2) const {
    radial_phi_lanes(k, r, g, phi1, phi2);
  }
  void jvp_angular(const ConstView<S>& k, const HalfEdgeView<S>& h, int64_t i, const S* u_edge,
                   const uint8_t* moving, S* scratch, S* fcw, S* row) const {
    jvp_angular_lanes(k, h, i, u_edge, moving, scratch, fcw, row, *w);
  }
  void hvp_angular(const ConstView<S>& k, const HalfEdgeView<S>& h, int64_t i, const S* grow,
                   const S* u_edge, const uint8_t* moving, S* scratch, S* fcw,
                   S* out_edge) const {
    hvp_angular_lanes(k, h, i, grow, u_edge, moving, scratch, fcw, out_edge, *w);
  }
};
