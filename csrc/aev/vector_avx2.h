// The vectorised CPU AEV on 8 lanes (AVX2 + FMA): neighbour staging, triple
// lists, the radial and angular blocks, and the per-atom loops, which call
// the 16-lane pieces (vector_avx512.h) where `wide`.
#pragma once
// (Included by aev/vector_cpu.cpp only, inside its TF_SIMD_AVX2 block and
// anonymous namespace: these are that one translation unit's pieces.)

// All neighbours of centre i from its half edges (which come sorted by
// species, with their vectors: build_half_edges), with their distances, into
// w.all; then those within rc_a into w.ang, in the same order.
TF_AVX2 void sorted_neighbors(const HalfEdges& h, int64_t i, const Consts<float>& k,
                              bool backward, CentreScratch& w) {
  NeighborArrays& all = w.all;
  NeighborArrays& ang = w.ang;
  const int64_t e0 = h.start[i];
  const float* v = centre_edges(h, i, k, all);
  for (int64_t e = 0; e < all.n; ++e) {
    all.x[e] = v[4 * e];
    all.y[e] = v[4 * e + 1];
    all.z[e] = v[4 * e + 2];
    all.edge[e] = e0 + e;
  }
  for (int64_t e = 0; e < all.n; e += 8) {
    const __m256 x = _mm256_loadu_ps(all.x.data() + e), y = _mm256_loadu_ps(all.y.data() + e),
                 z = _mm256_loadu_ps(all.z.data() + e);
    _mm256_storeu_ps(all.r.data() + e,
                     _mm256_sqrt_ps(_mm256_fmadd_ps(z, z, _mm256_fmadd_ps(y, y, _mm256_mul_ps(x, x)))));
  }
  all.cutoffs(k.rc_r, backward, k.cut);
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
  ang.cutoffs(k.rc_a, backward, k.cut);
}

// sorted_neighbors, on 16 lanes where `wide`.
TF_AVX2_INLINE void sorted_neighbors_any(const HalfEdges& h, int64_t i, const Consts<float>& k,
                                         bool backward, CentreScratch& w, bool wide) {
  if (wide) return sorted_neighbors512(h, i, k, backward, w);
  sorted_neighbors(h, i, k, backward, w);
}

// The triples of every species pair present, block after block, each block
// padded to a multiple of `pad` (8, or 16 for the 16-lane path); lanes
// run over the second neighbour l for a fixed first neighbour j. The geometry
// is make_triple's, lane for lane.
TF_AVX2 void list_triples(CentreScratch& w, const Consts<float>& k, bool backward, int64_t pad) {
  const int64_t n = w.ang.n;
  size_t cap = static_cast<size_t>(n * (n - 1) / 2 + 16 * (k.S * (k.S + 1) / 2 + 1));
  if (w.c.size() < cap) {
    for (auto* v : {&w.c, &w.sin_c, &w.mean_r, &w.fcc}) v->resize(cap);
  }
  if (backward && w.q.size() < cap) {
    for (auto* v : {&w.q, &w.clamped, &w.fc1, &w.fc2, &w.dfc1, &w.dfc2, &w.inv1, &w.inv2, &w.c12,
                    &w.c1, &w.c2})
      v->resize(cap);
    w.j.resize(cap);
    w.l.resize(cap);
  }
  w.blocks.clear();
  const __m256 tiny = _mm256_set1_ps(1e-10f), zero = _mm256_setzero_ps();
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  const __m256 shrink = _mm256_set1_ps(0.95f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t t = 0;
  for (int64_t s1 = 0; s1 < k.S; ++s1) {
    for (int64_t s2 = s1; s2 < k.S; ++s2) {
      const int64_t begin = t;
      for (int64_t j = w.ang.seg[s1]; j < w.ang.seg[s1 + 1]; ++j) {
        const __m256 xj = _mm256_set1_ps(w.ang.x[j]), yj = _mm256_set1_ps(w.ang.y[j]),
                     zj = _mm256_set1_ps(w.ang.z[j]), rj = _mm256_set1_ps(w.ang.r[j]),
                     fcj = _mm256_set1_ps(w.ang.fc[j]);
        const int64_t end = w.ang.seg[s2 + 1];
        for (int64_t l0 = s1 == s2 ? j + 1 : w.ang.seg[s2]; l0 < end; l0 += 8) {
          const __m256 rl = _mm256_loadu_ps(w.ang.r.data() + l0);
          const __m256 fcl = _mm256_loadu_ps(w.ang.fc.data() + l0);
          const __m256 dot = _mm256_add_ps(
              _mm256_add_ps(_mm256_mul_ps(xj, _mm256_loadu_ps(w.ang.x.data() + l0)),
                            _mm256_mul_ps(yj, _mm256_loadu_ps(w.ang.y.data() + l0))),
              _mm256_mul_ps(zj, _mm256_loadu_ps(w.ang.z.data() + l0)));
          const __m256 den = _mm256_mul_ps(rj, rl);
          const __m256 is_clamped = _mm256_cmp_ps(den, tiny, _CMP_LT_OQ);
          const __m256 q = _mm256_div_ps(dot, _mm256_blendv_ps(den, tiny, is_clamped));
          const __m256 c = _mm256_mul_ps(shrink, q);
          const __m256 one_minus = _mm256_fnmadd_ps(c, c, one);
          store_at(w.c, t, c);
          store_at(w.sin_c, t, _mm256_sqrt_ps(_mm256_max_ps(one_minus, zero)));
          store_at(w.mean_r, t, _mm256_mul_ps(_mm256_add_ps(rj, rl), half));
          store_at(w.fcc, t, _mm256_mul_ps(fcj, fcl));
          if (backward) {
            store_at(w.q, t, q);
            store_at(w.clamped, t, is_clamped);
            store_at(w.fc1, t, fcj);
            store_at(w.fc2, t, fcl);
            store_at(w.dfc1, t, _mm256_set1_ps(w.ang.dfc[j]));
            store_at(w.dfc2, t, _mm256_loadu_ps(w.ang.dfc.data() + l0));
            store_at(w.inv1, t, _mm256_set1_ps(w.ang.inv_r[j]));
            store_at(w.inv2, t, _mm256_loadu_ps(w.ang.inv_r.data() + l0));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.j.data() + t),
                                _mm256_set1_epi32(static_cast<int32_t>(j)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.l.data() + t),
                                _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(l0))));
          }
          t += std::min<int64_t>(8, end - l0);
        }
      }
      if (t == begin) continue;
      // Padding lanes: no cutoff, so they add exactly zero (c = 0 and a unit
      // sine keep their terms finite).
      for (int64_t u = t; u < t + pad; u += 8) {
        store_at(w.c, u, zero);
        store_at(w.sin_c, u, one);
        store_at(w.mean_r, u, zero);
        store_at(w.fcc, u, zero);
        if (backward)
          for (auto* v : {&w.q, &w.clamped, &w.fc1, &w.fc2, &w.dfc1, &w.dfc2, &w.inv1, &w.inv2})
            store_at(*v, u, zero);
      }
      w.blocks.push_back({k.pair_index(s1, s2), begin, t - begin});
      t = begin + (t - begin + pad - 1) / pad * pad;
    }
  }
}

// (1 + cos(acos(c) - ts_z)) / 2 from c and sqrt(1 - c^2).
TF_AVX2_INLINE __m256 section_base(const AngularConsts& ac, int s, __m256 c, __m256 sin_c) {
  const __m256 cdev = _mm256_fmadd_ps(c, ac.cos_z[s], _mm256_mul_ps(sin_c, ac.sin_z[s]));
  return _mm256_mul_ps(_mm256_add_ps(_mm256_set1_ps(1.0f), cdev), _mm256_set1_ps(0.5f));
}

// f2_a = exp(-eta_a (mean_r - shf_a)^2).
TF_AVX2_INLINE __m256 radial_factor(const AngularConsts& ac, int64_t a, __m256 m, __m256& x) {
  x = _mm256_sub_ps(m, ac.shf[a]);
  return simd::exp(_mm256_mul_ps(_mm256_mul_ps(ac.neg_eta[a], x), x));
}

// One block's terms added to its AEV block `out` (A x Z, z fastest): first
// f1 fc1 fc2 per triple and section, then per pass over the triples 8 / Z
// shifts, one accumulator per term.
template <int Z>
TF_AVX2 void block_forward(CentreScratch& w, const CentreScratch::Block& b,
                           const AngularConsts& ac, int64_t A, float* out) {
  constexpr int kShifts = 8 / Z;  // shifts per pass: 8 accumulators
  const int64_t vectors = (b.count + 7) / 8;
  if (w.f1.size() < static_cast<size_t>(vectors * Z * 8)) w.f1.resize(vectors * Z * 8);
  float* f1 = w.f1.data();
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t t = b.begin + 8 * v;
    const __m256 c = _mm256_loadu_ps(w.c.data() + t), s = _mm256_loadu_ps(w.sin_c.data() + t);
    const __m256 fcc2 = _mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_loadu_ps(w.fcc.data() + t));
    for (int zi = 0; zi < Z; ++zi) {
      const __m256 base = section_base(ac, zi, c, s);
      _mm256_storeu_ps(f1 + (v * Z + zi) * 8,
                       _mm256_mul_ps(fcc2, simd::exp(_mm256_mul_ps(ac.zeta[zi], simd::log(base)))));
    }
  }
  for (int64_t a0 = 0; a0 < A; a0 += kShifts) {
    __m256 acc[8];
    for (auto& x : acc) x = _mm256_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      const __m256 m = _mm256_loadu_ps(w.mean_r.data() + b.begin + 8 * v);
      __m256 f2[kShifts];
      for (int i = 0; i < kShifts; ++i) {
        __m256 x;
        f2[i] = a0 + i < A ? radial_factor(ac, a0 + i, m, x) : _mm256_setzero_ps();
      }
      for (int zi = 0; zi < Z; ++zi) {
        const __m256 f = _mm256_loadu_ps(f1 + (v * Z + zi) * 8);
        for (int i = 0; i < kShifts; ++i) acc[i * Z + zi] = _mm256_fmadd_ps(f2[i], f, acc[i * Z + zi]);
      }
    }
    add_sums(acc, std::min<int64_t>(8, (A - a0) * Z), out + a0 * Z);
  }
}

// One block's triples: their gradient coefficients from the block's AEV
// gradient g (A x Z). With s_val = sum g f, s_dc = sum g df/dc and s_dm = sum
// g df/d(mean r) over the block (without the cutoffs), the triple's gradient
// on the neighbours' vectors v1, v2 is
//   g1 = c12 v2 + c1 v1,  g2 = c12 v1 + c2 v2   (as add_triple_grad).
template <int Z>
TF_AVX2 void block_backward(CentreScratch& w, const CentreScratch::Block& b,
                            const AngularConsts& ac, int64_t A, const float* g) {
  const __m256 two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
  const __m256 shrink = _mm256_set1_ps(0.95f), big = _mm256_set1_ps(1e10f);
  for (int64_t t = b.begin; t < b.begin + b.count; t += 8) {
    const __m256 m = _mm256_loadu_ps(w.mean_r.data() + t);
    // g2[z] = sum_a g f2_a, gd2[z] = sum_a g df2_a/d(mean r)
    __m256 g2[Z], gd2[Z];
    for (int zi = 0; zi < Z; ++zi) g2[zi] = gd2[zi] = _mm256_setzero_ps();
    for (int64_t a = 0; a < A; ++a) {
      __m256 x;
      const __m256 f2 = radial_factor(ac, a, m, x);
      const __m256 df2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(ac.neg_eta[a], ac.neg_eta[a]), x), f2);
      for (int zi = 0; zi < Z; ++zi) {
        const __m256 gz = _mm256_broadcast_ss(g + a * Z + zi);
        g2[zi] = _mm256_fmadd_ps(gz, f2, g2[zi]);
        gd2[zi] = _mm256_fmadd_ps(gz, df2, gd2[zi]);
      }
    }
    const __m256 c = _mm256_loadu_ps(w.c.data() + t), s = _mm256_loadu_ps(w.sin_c.data() + t);
    const __m256 c_over_s = _mm256_div_ps(c, s);
    __m256 s_val = _mm256_setzero_ps(), s_dc = _mm256_setzero_ps(), s_dm = _mm256_setzero_ps();
    for (int zi = 0; zi < Z; ++zi) {
      // p = base^(zeta - 1): f1 = 2 p base, df1/dc = zeta p d(cos(acos(c) - ts))/dc
      const __m256 base = section_base(ac, zi, c, s);
      const __m256 p = simd::exp(_mm256_mul_ps(ac.zeta_m1[zi], simd::log(base)));
      const __m256 f1 = _mm256_mul_ps(_mm256_mul_ps(two, p), base);
      const __m256 df1 = _mm256_mul_ps(_mm256_mul_ps(ac.zeta[zi], p),
                                       _mm256_fnmadd_ps(c_over_s, ac.sin_z[zi], ac.cos_z[zi]));
      s_val = _mm256_fmadd_ps(g2[zi], f1, s_val);
      s_dc = _mm256_fmadd_ps(g2[zi], df1, s_dc);
      s_dm = _mm256_fmadd_ps(gd2[zi], f1, s_dm);
    }
    const __m256 fc1 = _mm256_loadu_ps(w.fc1.data() + t), fc2 = _mm256_loadu_ps(w.fc2.data() + t);
    const __m256 inv1 = _mm256_loadu_ps(w.inv1.data() + t), inv2 = _mm256_loadu_ps(w.inv2.data() + t);
    const __m256 fcc = _mm256_loadu_ps(w.fcc.data() + t);
    const __m256 d_cos = _mm256_mul_ps(_mm256_mul_ps(shrink, fcc), s_dc);
    const __m256 d_m = _mm256_mul_ps(_mm256_mul_ps(half, fcc), s_dm);
    const __m256 d_r1 = _mm256_fmadd_ps(_mm256_mul_ps(s_val, _mm256_loadu_ps(w.dfc1.data() + t)), fc2, d_m);
    const __m256 d_r2 = _mm256_fmadd_ps(_mm256_mul_ps(s_val, fc1), _mm256_loadu_ps(w.dfc2.data() + t), d_m);
    const __m256 c1 = _mm256_mul_ps(d_r1, inv1), c2 = _mm256_mul_ps(d_r2, inv2);
    const __m256 dq = _mm256_mul_ps(d_cos, _mm256_loadu_ps(w.q.data() + t));
    const __m256 clamped = _mm256_loadu_ps(w.clamped.data() + t);
    store_at(w.c12, t, _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(d_cos, inv1), inv2),
                                        _mm256_mul_ps(d_cos, big), clamped));
    store_at(w.c1, t, _mm256_blendv_ps(_mm256_fnmadd_ps(_mm256_mul_ps(dq, inv1), inv1, c1), c1, clamped));
    store_at(w.c2, t, _mm256_blendv_ps(_mm256_fnmadd_ps(_mm256_mul_ps(dq, inv2), inv2, c2), c2, clamped));
  }
}

// The angular terms of one centre: added to its AEV row (forward).
template <int Z>
TF_AVX2 void angular_forward(CentreScratch& w, const Consts<float>& k, const AngularConsts& ac,
                             float* row, bool wide) {
  list_triples(w, k, false, wide ? 16 : 8);
  for (const auto& b : w.blocks) {
    float* out = row + k.radial_len + b.pair * k.A * Z;
    if (wide)
      block_forward512<Z>(w, b, k, out);
    else
      block_forward<Z>(w, b, ac, k.A, out);
  }
}

// The angular terms' gradient of one centre, added to its half edges: each
// triple's coefficients go into a (neighbour x neighbour) table, then every
// neighbour's gradient is its row of the table times the neighbours' vectors.
template <int Z>
TF_AVX2 void angular_backward(CentreScratch& w, const Consts<float>& k, const AngularConsts& ac,
                              const float* grow, float* grad_edge, bool wide) {
  list_triples(w, k, true, wide ? 16 : 8);
  const int64_t n = w.ang.n, n8 = (n + 7) / 8 * 8;
  w.pair.assign(n * n8, 0.0f);
  w.diag.assign(n, 0.0f);
  for (const auto& b : w.blocks) {
    const float* g = grow + k.radial_len + b.pair * k.A * Z;
    if (wide)
      block_backward512<Z>(w, b, k, g);
    else
      block_backward<Z>(w, b, ac, k.A, g);
    for (int64_t t = b.begin; t < b.begin + b.count; ++t) {
      const int64_t j = w.j[t], l = w.l[t];
      w.diag[j] += w.c1[t];
      w.diag[l] += w.c2[t];
      w.pair[j * n8 + l] = w.c12[t];
      w.pair[l * n8 + j] = w.c12[t];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* row = w.pair.data() + j * n8;
    __m256 gx = _mm256_setzero_ps(), gy = _mm256_setzero_ps(), gz = _mm256_setzero_ps();
    for (int64_t l = 0; l < n8; l += 8) {
      const __m256 p = _mm256_loadu_ps(row + l);
      gx = _mm256_fmadd_ps(p, _mm256_loadu_ps(w.ang.x.data() + l), gx);
      gy = _mm256_fmadd_ps(p, _mm256_loadu_ps(w.ang.y.data() + l), gy);
      gz = _mm256_fmadd_ps(p, _mm256_loadu_ps(w.ang.z.data() + l), gz);
    }
    alignas(16) float s[4];
    _mm_store_ps(s, simd::hsum4(gx, gy, gz, _mm256_setzero_ps()));
    float* ge = grad_edge + 3 * w.ang.edge[j];
    ge[0] += s[0] + w.diag[j] * w.ang.x[j];
    ge[1] += s[1] + w.diag[j] * w.ang.y[j];
    ge[2] += s[2] + w.diag[j] * w.ang.z[j];
  }
}

// The radial terms of one centre into its AEV row: per species, passes of 8
// shifts over its neighbours, 8 neighbours per vector, one accumulator per shift.
TF_AVX2 void radial_forward(const NeighborArrays& nb, const Consts<float>& k, float* row) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 quarter = _mm256_set1_ps(0.25f);
  for (int64_t s = 0; s < k.S; ++s) {
    const int64_t b = nb.seg[s], e = nb.seg[s + 1];
    if (b == e) continue;
    for (int64_t q = 0; q < k.R; q += 8) {
      __m256 acc[8], shf[8], neg_eta[8];
      for (int i = 0; i < 8; ++i) {
        acc[i] = _mm256_setzero_ps();
        shf[i] = _mm256_set1_ps(k.shf_r[q + i]);
        neg_eta[i] = _mm256_set1_ps(-k.eta_r[q + i]);
      }
      for (int64_t v = b; v < e; v += 8) {
        const __m256 r = _mm256_loadu_ps(nb.r.data() + v);
        // lanes past the species' last neighbour add nothing
        const __m256 in = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(e - v)), lane));
        const __m256 scale = _mm256_and_ps(_mm256_mul_ps(quarter, _mm256_loadu_ps(nb.fc.data() + v)), in);
        for (int i = 0; i < 8; ++i) {
          const __m256 x = _mm256_sub_ps(r, shf[i]);
          acc[i] = _mm256_fmadd_ps(simd::exp(_mm256_mul_ps(_mm256_mul_ps(neg_eta[i], x), x)), scale, acc[i]);
        }
      }
      float* out = row + s * k.R + q;
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), sums8(acc)));
    }
  }
}

// The radial terms' gradient of one centre, added to its half edges: per
// neighbour (8 per vector) d/dr of its terms against the species' gradient,
// over r, times its vector (0 at r = 0, where the direction is undefined).
// With e_q = exp(-t_q x_q), x_q = r - shift_q and t_q = eta_q x_q,
//   d/dr sum_q g_q e_q fc / 4 = (dfc sum_q g_q e_q - 2 fc sum_q g_q e_q t_q) / 4:
// two sums per neighbour, the constants broadcast from memory (load ports; a
// broadcast from a register takes the shuffle port).
TF_AVX2 void radial_backward(const NeighborArrays& nb, const Consts<float>& k, const float* grow,
                             std::vector<float>& coef, float* grad_edge) {
  coef.resize(nb.n + NeighborArrays::kPad);
  const __m256 quarter = _mm256_set1_ps(0.25f), half = _mm256_set1_ps(0.5f);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t s = 0; s < k.S; ++s) {
    const float* g = grow + s * k.R;
    for (int64_t v = nb.seg[s]; v < nb.seg[s + 1]; v += 8) {  // (the next species overwrites the tail)
      const __m256 r = _mm256_loadu_ps(nb.r.data() + v);
      __m256 sum_e = zero, sum_et = zero;
      for (int64_t q = 0; q < k.R; ++q) {
        const __m256 x = _mm256_sub_ps(r, _mm256_broadcast_ss(k.shf_r.data() + q));
        const __m256 t = _mm256_mul_ps(_mm256_broadcast_ss(k.eta_r.data() + q), x);
        const __m256 ge = _mm256_mul_ps(_mm256_broadcast_ss(g + q),
                                        simd::exp(_mm256_fnmadd_ps(t, x, zero)));
        sum_e = _mm256_add_ps(sum_e, ge);
        sum_et = _mm256_fmadd_ps(ge, t, sum_et);
      }
      const __m256 fc = _mm256_loadu_ps(nb.fc.data() + v), dfc = _mm256_loadu_ps(nb.dfc.data() + v);
      const __m256 d = _mm256_fmsub_ps(_mm256_mul_ps(quarter, dfc), sum_e,
                                       _mm256_mul_ps(_mm256_mul_ps(half, fc), sum_et));
      _mm256_storeu_ps(coef.data() + v, _mm256_mul_ps(d, _mm256_loadu_ps(nb.inv_r.data() + v)));
    }
  }
  add_radial_edges(nb, coef, grad_edge);
}

// wide: the exp and log on 16 lanes (AVX-512), the same bits.
TF_AVX2 void forward_atoms_avx2(int64_t begin, int64_t end, const int64_t* species,
                                const HalfEdges& h, const Consts<float>& k, float* aev,
                                bool wide) {
  CentreScratch w;
  const AngularConsts ac(k);
  for (int64_t i = begin; i < end; ++i) {
    float* row = aev + i * k.F;
    std::fill(row, row + k.F, 0.0f);  // (the output is allocated uninitialised)
    if (species[i] < 0) continue;
    sorted_neighbors_any(h, i, k, false, w, wide);
    if (wide)
      radial_forward512(w.all, k, row);
    else
      radial_forward(w.all, k, row);
    switch (k.Z) {  // (no lambda here: it would not inherit this function's target)
      case 1: angular_forward<1>(w, k, ac, row, wide); break;
      case 2: angular_forward<2>(w, k, ac, row, wide); break;
      case 4: angular_forward<4>(w, k, ac, row, wide); break;
      default: angular_forward<8>(w, k, ac, row, wide); break;
    }
  }
}

// wide: the radial and angular terms on 16 lanes (AVX-512), the same bits.
TF_AVX2 void backward_atoms_avx2(int64_t begin, int64_t end, const int64_t* species,
                                 const HalfEdges& h, const Consts<float>& k,
                                 const float* grad_aev, float* grad_edge, bool wide) {
  CentreScratch w;
  const AngularConsts ac(k);
  if (begin < end) prefetch_grad_row(h, begin, k, grad_aev + begin * k.F);
  for (int64_t i = begin; i < end; ++i) {
    if (i + 1 < end) prefetch_grad_row(h, i + 1, k, grad_aev + (i + 1) * k.F);
    if (species[i] < 0) continue;
    const float* grow = grad_aev + i * k.F;
    sorted_neighbors_any(h, i, k, true, w, wide);
    if (wide)
      radial_backward512(w.all, k, grow, w.coef, grad_edge);
    else
      radial_backward(w.all, k, grow, w.coef, grad_edge);
    switch (k.Z) {
      case 1: angular_backward<1>(w, k, ac, grow, grad_edge, wide); break;
      case 2: angular_backward<2>(w, k, ac, grow, grad_edge, wide); break;
      case 4: angular_backward<4>(w, k, ac, grow, grad_edge, wide); break;
      default: angular_backward<8>(w, k, ac, grow, grad_edge, wide); break;
    }
  }
}
