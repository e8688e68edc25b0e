// The float64 AEV kernels, written once over the lane operations of
// aev/vector_f64_lanes.h: aev/vector_f64_cpu.cpp includes this file twice,
// in namespace x4 (4 lanes, AVX2) and x8 (8 lanes, AVX-512), with TF_F64_FN
// and TF_F64_INLINE defined to that width's target attributes. The structure
// is the float32 kernels' (aev/vector_avx2.h): neighbours sorted by species,
// the radial terms of several neighbours per vector, the angular terms of
// several triples of one species pair per vector. Every value of one
// neighbour or triple is computed by the same operations in its own lane,
// and every sum over neighbours or triples runs on 4 lanes in one order
// (acc4, block_sums, add_table_grads), so both widths give the same bits.
// (No include guard: included once per width.)

// fc (and dfc, inv_r) of every neighbour for the cutoff rc, as
// aev_math::cutoff_value / cutoff_deriv (the cosine's accurate tail, the
// smooth cutoff's parts in TorchANI's order).
TF_F64_FN void cutoffs(NeighborsF64& nb, double rc, bool backward,
                       const aev_math::CutoffFn<double>& fn) {
  const vd cut = bc(rc), one = bc(1.0), zero = bc(0.0);
  if (fn.kind == aev_math::kCutoffSmooth) {
    const vd eps = bc(fn.eps), neg_n = bc(-static_cast<double>(fn.order));
    for (int64_t e = 0; e < nb.n; e += kLanes) {
      const vd rr = ld(nb.r.data() + e);
      const vd x = div(rr, cut);
      vd xn1 = one;  // x^(n-1)
      for (int64_t j = 1; j < fn.order; ++j) xn1 = j == 1 ? x : mul(xn1, x);
      const vd xn = fn.order == 1 ? x : mul(xn1, x);
      const vd u0 = sub(one, xn);
      const md free = ge(u0, eps);
      const vd u = sel(free, u0, eps);
      const vd f = simd::exp(sub(one, div(one, u)));
      st(nb.fc.data() + e, f);
      if (!backward) continue;
      const vd g = div(mul(neg_n, xn1), mul(mul(cut, u), u));
      st(nb.dfc.data() + e, mul(f, keep(free, g)));
      st(nb.inv_r.data() + e, keep(gt(rr, zero), div(one, rr)));
    }
    return;
  }
  const double w_s = aev_math::kPi / rc;
  const vd w = bc(w_s), half = bc(0.5), neg_half_w = bc(-0.5 * w_s);
  const vd half_w = bc((aev_math::kPi / 2) / rc);
  for (int64_t e = 0; e < nb.n; e += kLanes) {
    const vd rr = ld(nb.r.data() + e);
    vd c, s;
    simd::cos_sin_0_pi(mul(rr, w), c, s);
    // aev_math::cutoff_tail: where fc rounds to 0 below rc, (pi (rc - r) / (2 rc))^2.
    const vd f = fma(half, c, half);
    const md tail = both(eq(f, zero), lt(rr, cut));
    const vd t = mul(sub(cut, rr), half_w);
    st(nb.fc.data() + e, sel(tail, mul(t, t), f));
    if (!backward) continue;
    st(nb.dfc.data() + e, mul(neg_half_w, s));
    st(nb.inv_r.data() + e, keep(gt(rr, zero), div(one, rr)));
  }
}

// All neighbours of centre i from its half edges (sorted by species, with
// their vectors: build_half_edges), with their distances and cutoffs, into
// w.all; then those within rc_a into w.ang, in the same order.
TF_F64_FN void sorted_neighbors(const HalfEdges& h, int64_t i, const Consts<double>& k,
                                bool backward, ScratchF64& w) {
  NeighborsF64& all = w.all;
  NeighborsF64& ang = w.ang;
  const int64_t e0 = h.start[i];
  const double* v = centre_edges(h, i, k, all);
  for (int64_t e = 0; e < all.n; ++e) {
    all.x[e] = v[4 * e];
    all.y[e] = v[4 * e + 1];
    all.z[e] = v[4 * e + 2];
    all.edge[e] = e0 + e;
  }
  for (int64_t e = 0; e < all.n; e += kLanes) {
    const vd x = ld(all.x.data() + e), y = ld(all.y.data() + e), z = ld(all.z.data() + e);
    st(all.r.data() + e, vsqrt(fma(z, z, fma(y, y, mul(x, x)))));
  }
  cutoffs(all, k.rc_r, backward, k.cut);
  int64_t count = 0;
  for (int64_t e = 0; e < all.n; ++e) count += all.r[e] <= k.rc_a;
  ang.resize(count, k.S);
  int64_t a = 0;
  for (int64_t s = 0; s < k.S; ++s) {
    ang.seg[s] = a;
    for (int64_t e = all.seg[s]; e < all.seg[s + 1]; ++e) {  // (branch-free compaction)
      ang.x[a] = all.x[e];
      ang.y[a] = all.y[e];
      ang.z[a] = all.z[e];
      ang.r[a] = all.r[e];
      ang.edge[a] = all.edge[e];
      a += all.r[e] <= k.rc_a;
    }
  }
  ang.seg[k.S] = a;
  cutoffs(ang, k.rc_a, backward, k.cut);
}

TF_F64_INLINE void put(std::vector<double>& v, int64_t t, vd x) { st(v.data() + t, x); }

// The triples of every species pair present, block after block, each block
// padded to whole vectors with triples that add zero; lanes run over the
// second neighbour l for a fixed first neighbour j. The geometry is
// make_triple's, lane for lane.
TF_F64_FN void list_triples(ScratchF64& w, const Consts<double>& k, bool backward) {
  const int64_t n = w.ang.n;
  const size_t cap = static_cast<size_t>(n * (n - 1) / 2 + 2 * kLanes * (k.S * (k.S + 1) / 2 + 1));
  if (w.c.size() < cap)
    for (auto* v : {&w.c, &w.sin_c, &w.mean_r, &w.fcc}) v->resize(cap);
  if (backward && w.q.size() < cap) {
    for (auto* v : {&w.q, &w.clamped, &w.fc1, &w.fc2, &w.dfc1, &w.dfc2, &w.inv1, &w.inv2, &w.c12,
                    &w.c1, &w.c2})
      v->resize(cap);
    w.j.resize(cap);
    w.l.resize(cap);
  }
  w.blocks.clear();
  const vd tiny = bc(1e-10), zero = bc(0.0), half = bc(0.5), one = bc(1.0), shrink = bc(0.95);
  const NeighborsF64& ang = w.ang;
  int64_t t = 0;
  for (int64_t s1 = 0; s1 < k.S; ++s1) {
    for (int64_t s2 = s1; s2 < k.S; ++s2) {
      const int64_t begin = t;
      for (int64_t j = ang.seg[s1]; j < ang.seg[s1 + 1]; ++j) {
        const vd xj = bc(ang.x[j]), yj = bc(ang.y[j]), zj = bc(ang.z[j]), rj = bc(ang.r[j]),
                 fcj = bc(ang.fc[j]);
        const int64_t end = ang.seg[s2 + 1];
        for (int64_t l0 = s1 == s2 ? j + 1 : ang.seg[s2]; l0 < end; l0 += kLanes) {
          const vd rl = ld(ang.r.data() + l0), fcl = ld(ang.fc.data() + l0);
          const vd dot = add(add(mul(xj, ld(ang.x.data() + l0)), mul(yj, ld(ang.y.data() + l0))),
                             mul(zj, ld(ang.z.data() + l0)));
          const vd den = mul(rj, rl);
          const md is_clamped = lt(den, tiny);
          const vd q = div(dot, sel(is_clamped, tiny, den));
          const vd c = mul(shrink, q);
          put(w.c, t, c);
          put(w.sin_c, t, vsqrt(vmax(fnma(c, c, one), zero)));
          put(w.mean_r, t, mul(add(rj, rl), half));
          put(w.fcc, t, mul(fcj, fcl));
          if (backward) {
            put(w.q, t, q);
            put(w.clamped, t, sel(is_clamped, one, zero));
            put(w.fc1, t, fcj);
            put(w.fc2, t, fcl);
            put(w.dfc1, t, bc(ang.dfc[j]));
            put(w.dfc2, t, ld(ang.dfc.data() + l0));
            put(w.inv1, t, bc(ang.inv_r[j]));
            put(w.inv2, t, ld(ang.inv_r.data() + l0));
            for (int64_t u = 0; u < kLanes; ++u) {
              w.j[t + u] = static_cast<int32_t>(j);
              w.l[t + u] = static_cast<int32_t>(l0 + u);
            }
          }
          t += std::min<int64_t>(kLanes, end - l0);
        }
      }
      if (t == begin) continue;
      // Padding lanes: no cutoff, so they add exactly zero (c = 0 and a unit
      // sine keep their terms finite).
      put(w.c, t, zero);
      put(w.sin_c, t, one);
      put(w.mean_r, t, zero);
      put(w.fcc, t, zero);
      if (backward)
        for (auto* v : {&w.q, &w.clamped, &w.fc1, &w.fc2, &w.dfc1, &w.dfc2, &w.inv1, &w.inv2})
          put(*v, t, zero);
      w.blocks.push_back({k.pair_index(s1, s2), begin, t - begin});
      t = begin + (t - begin + kLanes - 1) / kLanes * kLanes;
    }
  }
}

// (1 + cos(acos(c) - ts_z)) / 2 from c and sqrt(1 - c^2).
TF_F64_INLINE vd section_base(const Consts<double>& k, int s, vd c, vd sin_c) {
  const vd cdev = fma(c, bc(k.cos_z[s]), mul(sin_c, bc(k.sin_z[s])));
  return mul(add(bc(1.0), cdev), bc(0.5));
}

// The angular terms of one centre, added to its AEV row: per block, f1 fcc
// and f2 of every triple (all sections and shifts), then their products
// summed (block_sums).
template <int Z>
TF_F64_FN void angular_forward(ScratchF64& w, const Consts<double>& k, double* row) {
  list_triples(w, k, false);
  const int64_t A = k.A;
  for (const auto& b : w.blocks) {
    const int64_t T = (b.count + kLanes - 1) / kLanes * kLanes;
    if (w.f.size() < static_cast<size_t>((Z + A) * T)) w.f.resize((Z + A) * T);
    double* f1 = w.f.data();
    double* f2 = f1 + Z * T;
    for (int64_t u = 0; u < b.count; u += kLanes) {
      const int64_t t = b.begin + u;
      const vd c = ld(w.c.data() + t), s = ld(w.sin_c.data() + t);
      const vd fcc2 = mul(bc(2.0), ld(w.fcc.data() + t));
      for (int zi = 0; zi < Z; ++zi) {
        const vd base = section_base(k, zi, c, s);
        st(f1 + zi * T + u, mul(fcc2, simd::exp(mul(bc(k.zeta[zi]), simd::log(base)))));
      }
      const vd m = ld(w.mean_r.data() + t);
      for (int64_t a = 0; a < A; ++a) {
        const vd x = sub(m, bc(k.shf_a[a]));
        st(f2 + a * T + u, simd::exp(mul(mul(bc(-k.eta_a[a]), x), x)));
      }
    }
    block_sums<Z>(f1, f2, T, b.count, A, row + k.radial_len + b.pair * A * Z);
  }
}

// One block's triples: their gradient coefficients from the block's AEV
// gradient g (A x Z), as the float32 block_backward (aev/vector_avx2.h):
//   g1 = c12 v2 + c1 v1,  g2 = c12 v1 + c2 v2   (add_triple_grad).
template <int Z>
TF_F64_FN void block_backward(ScratchF64& w, const ScratchF64::Block& b, const Consts<double>& k,
                              const double* g) {
  const vd two = bc(2.0), half = bc(0.5), shrink = bc(0.95), big = bc(1e10), zero = bc(0.0);
  for (int64_t t = b.begin; t < b.begin + b.count; t += kLanes) {
    const vd m = ld(w.mean_r.data() + t);
    // g2[z] = sum_a g f2_a, gd2[z] = sum_a g df2_a/d(mean r)
    vd g2[Z], gd2[Z];
    for (int zi = 0; zi < Z; ++zi) g2[zi] = gd2[zi] = zero;
    for (int64_t a = 0; a < k.A; ++a) {
      const vd neg_eta = bc(-k.eta_a[a]);
      const vd x = sub(m, bc(k.shf_a[a]));
      const vd f2 = simd::exp(mul(mul(neg_eta, x), x));
      const vd df2 = mul(mul(add(neg_eta, neg_eta), x), f2);
      for (int zi = 0; zi < Z; ++zi) {
        const vd gz = bc(g[a * Z + zi]);
        g2[zi] = fma(gz, f2, g2[zi]);
        gd2[zi] = fma(gz, df2, gd2[zi]);
      }
    }
    const vd c = ld(w.c.data() + t), s = ld(w.sin_c.data() + t);
    const vd c_over_s = div(c, s);
    vd s_val = zero, s_dc = zero, s_dm = zero;
    for (int zi = 0; zi < Z; ++zi) {
      // p = base^(zeta - 1): f1 = 2 p base, df1/dc = zeta p d(cos(acos(c) - ts))/dc
      const vd base = section_base(k, zi, c, s);
      const vd p = simd::exp(mul(bc(k.zeta[zi] - 1.0), simd::log(base)));
      const vd f1 = mul(mul(two, p), base);
      const vd df1 = mul(mul(bc(k.zeta[zi]), p), fnma(c_over_s, bc(k.sin_z[zi]), bc(k.cos_z[zi])));
      s_val = fma(g2[zi], f1, s_val);
      s_dc = fma(g2[zi], df1, s_dc);
      s_dm = fma(gd2[zi], f1, s_dm);
    }
    const vd fc1 = ld(w.fc1.data() + t), fc2 = ld(w.fc2.data() + t);
    const vd inv1 = ld(w.inv1.data() + t), inv2 = ld(w.inv2.data() + t);
    const vd fcc = ld(w.fcc.data() + t);
    const vd d_cos = mul(mul(shrink, fcc), s_dc);
    const vd d_m = mul(mul(half, fcc), s_dm);
    const vd d_r1 = fma(mul(s_val, ld(w.dfc1.data() + t)), fc2, d_m);
    const vd d_r2 = fma(mul(s_val, fc1), ld(w.dfc2.data() + t), d_m);
    const vd c1 = mul(d_r1, inv1), c2 = mul(d_r2, inv2);
    const vd dq = mul(d_cos, ld(w.q.data() + t));
    const md clamped = gt(ld(w.clamped.data() + t), zero);
    put(w.c12, t, sel(clamped, mul(d_cos, big), mul(mul(d_cos, inv1), inv2)));
    put(w.c1, t, sel(clamped, c1, fnma(mul(dq, inv1), inv1, c1)));
    put(w.c2, t, sel(clamped, c2, fnma(mul(dq, inv2), inv2, c2)));
  }
}

// The angular terms' gradient of one centre, added to its half edges: each
// triple's coefficients go into a (neighbour x neighbour) table, then every
// neighbour's gradient is its row of the table times the neighbours' vectors.
template <int Z>
TF_F64_FN void angular_backward(ScratchF64& w, const Consts<double>& k, const double* grow,
                                double* grad_edge) {
  list_triples(w, k, true);
  const int64_t n = w.ang.n, n4 = (n + 3) / 4 * 4;
  w.pair.assign(n * n4, 0.0);
  w.diag.assign(n, 0.0);
  for (const auto& b : w.blocks) {
    block_backward<Z>(w, b, k, grow + k.radial_len + b.pair * k.A * Z);
    for (int64_t t = b.begin; t < b.begin + b.count; ++t) {
      const int64_t j = w.j[t], l = w.l[t];
      w.diag[j] += w.c1[t];
      w.diag[l] += w.c2[t];
      w.pair[j * n4 + l] = w.c12[t];
      w.pair[l * n4 + j] = w.c12[t];
    }
  }
  add_table_grads(w, grad_edge);
}

// The radial terms of one centre into its AEV row: per species, passes of 8
// shifts over its neighbours, one accumulator per shift.
TF_F64_FN void radial_forward(const NeighborsF64& nb, const Consts<double>& k, double* row) {
  const vd quarter = bc(0.25);
  for (int64_t s = 0; s < k.S; ++s) {
    const int64_t b = nb.seg[s], e = nb.seg[s + 1];
    if (b == e) continue;
    for (int64_t q = 0; q < k.R; q += 8) {
      __m256d acc[8];
      for (auto& x : acc) x = _mm256_setzero_pd();
      for (int64_t v = b; v < e; v += kLanes) {
        const vd r = ld(nb.r.data() + v);
        // lanes past the species' last neighbour add nothing
        const vd scale = keep(first(e - v), mul(quarter, ld(nb.fc.data() + v)));
        for (int i = 0; i < 8; ++i) {
          const vd x = sub(r, bc(k.shf_r[q + i]));
          acc4(acc[i], simd::exp(mul(mul(bc(-k.eta_r[q + i]), x), x)), scale);
        }
      }
      add_sums(acc, 8, row + s * k.R + q);
    }
  }
}

// The radial terms' gradient of one centre, added to its half edges, as the
// float32 radial_backward: per neighbour d/dr of its terms against the
// species' gradient, over r, times its vector (0 at r = 0).
TF_F64_FN void radial_backward(const NeighborsF64& nb, const Consts<double>& k, const double* grow,
                               std::vector<double>& coef, double* grad_edge) {
  coef.resize(nb.n + NeighborsF64::kPad);
  const vd quarter = bc(0.25), half = bc(0.5), zero = bc(0.0);
  for (int64_t s = 0; s < k.S; ++s) {
    const double* g = grow + s * k.R;
    for (int64_t v = nb.seg[s]; v < nb.seg[s + 1]; v += kLanes) {  // (the next species overwrites the tail)
      const vd r = ld(nb.r.data() + v);
      vd sum_e = zero, sum_et = zero;
      for (int64_t q = 0; q < k.R; ++q) {
        const vd x = sub(r, bc(k.shf_r[q]));
        const vd t = mul(bc(k.eta_r[q]), x);
        const vd ge = mul(bc(g[q]), simd::exp(fnma(t, x, zero)));
        sum_e = add(sum_e, ge);
        sum_et = fma(ge, t, sum_et);
      }
      const vd fc = ld(nb.fc.data() + v), dfc = ld(nb.dfc.data() + v);
      const vd d = fms(mul(quarter, dfc), sum_e, mul(mul(half, fc), sum_et));
      st(coef.data() + v, mul(d, ld(nb.inv_r.data() + v)));
    }
  }
  add_radial_edges(nb, coef, grad_edge);
}

TF_F64_FN void forward_atoms(int64_t begin, int64_t end, const int64_t* species, const HalfEdges& h,
                             const Consts<double>& k, double* aev) {
  ScratchF64 w;
  for (int64_t i = begin; i < end; ++i) {
    double* row = aev + i * k.F;
    std::fill(row, row + k.F, 0.0);  // (the output is allocated uninitialised)
    if (species[i] < 0) continue;
    sorted_neighbors(h, i, k, false, w);
    radial_forward(w.all, k, row);
    switch (k.Z) {  // (no lambda here: it would not inherit this function's target)
      case 1: angular_forward<1>(w, k, row); break;
      case 2: angular_forward<2>(w, k, row); break;
      case 4: angular_forward<4>(w, k, row); break;
      default: angular_forward<8>(w, k, row); break;
    }
  }
}

TF_F64_FN void backward_atoms(int64_t begin, int64_t end, const int64_t* species,
                              const HalfEdges& h, const Consts<double>& k, const double* grad_aev,
                              double* grad_edge) {
  ScratchF64 w;
  if (begin < end) prefetch_grad_row_f64(h, begin, k, grad_aev + begin * k.F);
  for (int64_t i = begin; i < end; ++i) {
    if (i + 1 < end) prefetch_grad_row_f64(h, i + 1, k, grad_aev + (i + 1) * k.F);
    if (species[i] < 0) continue;
    const double* grow = grad_aev + i * k.F;
    sorted_neighbors(h, i, k, true, w);
    radial_backward(w.all, k, grow, w.coef, grad_edge);
    switch (k.Z) {
      case 1: angular_backward<1>(w, k, grow, grad_edge); break;
      case 2: angular_backward<2>(w, k, grow, grad_edge); break;
      case 4: angular_backward<4>(w, k, grow, grad_edge); break;
      default: angular_backward<8>(w, k, grow, grad_edge); break;
    }
  }
}

#undef TF_F64_FN
#undef TF_F64_INLINE
