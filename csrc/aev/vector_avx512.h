// The vectorised CPU AEV on 16 lanes (AVX-512): the neighbour staging, the
// exp/log of several shifts side by side, and the 16-lane blocks of the
// forward and backward. Same operations lane for lane as the 8-lane code, so
// the same bits.
#pragma once
// (Included by aev/vector_cpu.cpp only, inside its TF_SIMD_AVX2 block and
// anonymous namespace: these are that one translation unit's pieces.)

// The half-edge vectors e .. e + 3 (x, y, z, 0 each), of which only the first
// `left` exist (the others read as zeros).
TF_AVX512_INLINE __m512 four_vectors(const float* v, int64_t e, int64_t left) {
  const int64_t m = std::clamp<int64_t>(left, 0, 4);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (4 * m)) - 1), v + 4 * e);
}

// sorted_neighbors on 16 lanes (AVX-512): the same values (the same
// operations lane by lane), the vectors split into x, y, z by permutes and
// the angular neighbours compacted by lane compression, in the same order.
TF_AVX512 void sorted_neighbors512(const HalfEdges& h, int64_t i, const Consts<float>& k,
                                   bool backward, CentreScratch& w) {
  NeighborArrays& all = w.all;
  NeighborArrays& ang = w.ang;
  const int64_t e0 = h.start[i];
  const float* v = centre_edges(h, i, k, all);
  // Lanes 0-7: component c of 8 neighbours from two vectors of 4 (x, y, z, 0);
  // lanes 8-15: component c + 1.
  const __m512i xy = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i zw = _mm512_add_epi32(xy, _mm512_set1_epi32(2));
  const __m512i iota = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  const __m512 rc_a = _mm512_set1_ps(k.rc_a);
  int64_t count = 0;
  for (int64_t e = 0; e < all.n; e += 16) {
    const int64_t left = all.n - e;  // read only this centre's half edges
    const __m512 a0 = four_vectors(v, e, left), a1 = four_vectors(v, e + 4, left - 4),
                 a2 = four_vectors(v, e + 8, left - 8), a3 = four_vectors(v, e + 12, left - 12);
    const __m512 lo = _mm512_permutex2var_ps(a0, xy, a1), hi = _mm512_permutex2var_ps(a2, xy, a3);
    constexpr int kLow = _MM_SHUFFLE(1, 0, 1, 0), kHigh = _MM_SHUFFLE(3, 2, 3, 2);  // halves
    const __m512 x = _mm512_shuffle_f32x4(lo, hi, kLow), y = _mm512_shuffle_f32x4(lo, hi, kHigh);
    const __m512 z = _mm512_shuffle_f32x4(_mm512_permutex2var_ps(a0, zw, a1),
                                          _mm512_permutex2var_ps(a2, zw, a3), kLow);
    const __m512 r2 = _mm512_fmadd_ps(z, z, _mm512_fmadd_ps(y, y, _mm512_mul_ps(x, x)));
    const __m512 r = _mm512_sqrt_ps(r2);
    _mm512_storeu_ps(all.x.data() + e, x);
    _mm512_storeu_ps(all.y.data() + e, y);
    _mm512_storeu_ps(all.z.data() + e, z);
    _mm512_storeu_ps(all.r.data() + e, r);
    const __m512i first = _mm512_add_epi64(_mm512_set1_epi64(e0 + e), iota);
    _mm512_storeu_si512(all.edge.data() + e, first);
    _mm512_storeu_si512(all.edge.data() + e + 8, _mm512_add_epi64(first, _mm512_set1_epi64(8)));
    const __mmask16 valid = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    count += __builtin_popcount(_mm512_mask_cmp_ps_mask(valid, r, rc_a, _CMP_LE_OQ));
  }
  all.cutoffs(k.rc_r, backward, k.cut);
  ang.resize(count, k.S);
  int64_t a = 0;
  for (int64_t s = 0; s < k.S; ++s) {
    ang.seg[s] = a;
    for (int64_t e = all.seg[s], end = all.seg[s + 1]; e < end; e += 16) {
      const int64_t left = end - e;
      const __mmask16 valid = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
      const __m512 r = _mm512_loadu_ps(all.r.data() + e);
      const __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, r, rc_a, _CMP_LE_OQ);
      // Whole vectors stored at a: the lanes past the kept ones are zeros, and
      // ang's arrays hold count + 16 entries.
      for (auto [src, dst] : {std::pair{&all.x, &ang.x}, {&all.y, &ang.y}, {&all.z, &ang.z}})
        _mm512_storeu_ps(dst->data() + a,
                         _mm512_maskz_compress_ps(keep, _mm512_loadu_ps(src->data() + e)));
      _mm512_storeu_ps(ang.r.data() + a, _mm512_maskz_compress_ps(keep, r));
      const __mmask8 k0 = static_cast<__mmask8>(keep), k1 = static_cast<__mmask8>(keep >> 8);
      const int64_t* edge = all.edge.data() + e;
      _mm512_storeu_si512(ang.edge.data() + a,
                          _mm512_maskz_compress_epi64(k0, _mm512_loadu_si512(edge)));
      _mm512_storeu_si512(ang.edge.data() + a + __builtin_popcount(k0),
                          _mm512_maskz_compress_epi64(k1, _mm512_loadu_si512(edge + 8)));
      a += __builtin_popcount(keep);
    }
  }
  ang.seg[k.S] = a;
  ang.cutoffs(k.rc_a, backward, k.cut);
}

// section_base and radial_factor on 16 lanes (the constants broadcast from
// k), for all sections or shifts of 16 triples at once, their exps and logs
// side by side (simd::exp_n, log_n): the same operations, so the same bits.
TF_AVX512_INLINE __m512 section_base(const Consts<float>& k, int s, __m512 c, __m512 sin_c) {
  const __m512 cdev = _mm512_fmadd_ps(c, _mm512_set1_ps(k.cos_z[s]),
                                      _mm512_mul_ps(sin_c, _mm512_set1_ps(k.sin_z[s])));
  return _mm512_mul_ps(_mm512_add_ps(_mm512_set1_ps(1.0f), cdev), _mm512_set1_ps(0.5f));
}

// base[z] = section_base, p[z] = base[z]^(zeta_z - dz).
template <int Z>
TF_AVX512_INLINE void section_powers(const Consts<float>& k, __m512 c, __m512 sin_c, float dz,
                                     __m512 (&base)[Z], __m512 (&p)[Z]) {
  for (int zi = 0; zi < Z; ++zi) base[zi] = section_base(k, zi, c, sin_c);
  simd::log_n(base, p);
  for (int zi = 0; zi < Z; ++zi) p[zi] = _mm512_mul_ps(_mm512_set1_ps(k.zeta[zi] - dz), p[zi]);
  simd::exp_n(p, p);
}

// f2[a] = radial_factor of shift a for a < N, with x[a] = mean_r - shf_a
// (a >= A: the last shift again, unused), their exps side by side.
template <int N>
TF_AVX512_INLINE void radial_factors_n(const Consts<float>& k, __m512 m, __m512 (&x)[kMaxShifts],
                                       __m512 (&f2)[kMaxShifts]) {
  __m512 u[N];
  for (int a = 0; a < N; ++a) {
    const int64_t s = std::min<int64_t>(a, k.A - 1);
    x[a] = _mm512_sub_ps(m, _mm512_set1_ps(k.shf_a[s]));
    u[a] = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(-k.eta_a[s]), x[a]), x[a]);
  }
  simd::exp_n(u, u);
  for (int a = 0; a < N; ++a) f2[a] = u[a];
}

// radial_factors_n for every shift a < A: 4 exps when A <= 4 (ANI-1x), else 8.
TF_AVX512_INLINE void radial_factors(const Consts<float>& k, __m512 m, __m512 (&x)[kMaxShifts],
                                     __m512 (&f2)[kMaxShifts]) {
  if (k.A <= 4)
    radial_factors_n<4>(k, m, x, f2);
  else
    radial_factors_n<kMaxShifts>(k, m, x, f2);
}

TF_AVX512_INLINE __m512 load16(const std::vector<float>& v, int64_t t) {
  return _mm512_loadu_ps(v.data() + t);
}

// The two halves of f at lo and hi (vectors of 8 triples).
TF_AVX512_INLINE void store_halves(float* lo, float* hi, __m512 f) {
  _mm256_storeu_ps(lo, _mm512_castps512_ps256(f));
  _mm256_storeu_ps(hi, _mm512_extractf32x8_ps(f, 1));
}

// block_forward with its exp and log on 16 lanes (AVX-512: two vectors of 8
// triples at a time) and its sums on 8, in block_forward's order: the same
// bits. The block is padded to a multiple of 16 (list_triples). Its first
// pass also keeps f2 of every triple and shift (all shifts' exps side by
// side), which the passes over the shifts then read.
template <int Z>
TF_AVX512 void block_forward512(CentreScratch& w, const CentreScratch::Block& b,
                                const Consts<float>& k, float* out) {
  constexpr int kShifts = 8 / Z;
  const int64_t A = k.A, vectors = (b.count + 7) / 8;
  // f1 (vectors, Z, 8) as block_forward's, then f2 (vectors, kMaxShifts, 8)
  const size_t size = static_cast<size_t>((vectors + 1) * (Z + kMaxShifts) * 8);
  if (w.f1.size() < size) w.f1.resize(size);
  float* f1 = w.f1.data();
  float* f2 = f1 + (vectors + 1) * Z * 8;
  for (int64_t v = 0; v < vectors; v += 2) {
    const int64_t t = b.begin + 8 * v;
    const __m512 c = load16(w.c, t), s = load16(w.sin_c, t);
    const __m512 fcc2 = _mm512_mul_ps(_mm512_set1_ps(2.0f), load16(w.fcc, t));
    __m512 base[Z], p[Z];
    section_powers(k, c, s, 0.0f, base, p);
    for (int zi = 0; zi < Z; ++zi)
      store_halves(f1 + (v * Z + zi) * 8, f1 + ((v + 1) * Z + zi) * 8, _mm512_mul_ps(fcc2, p[zi]));
    __m512 x[kMaxShifts], e[kMaxShifts];
    radial_factors(k, load16(w.mean_r, t), x, e);
    for (int64_t a = 0; a < A; ++a)
      store_halves(f2 + (v * kMaxShifts + a) * 8, f2 + ((v + 1) * kMaxShifts + a) * 8, e[a]);
  }
  for (int64_t a0 = 0; a0 < A; a0 += kShifts) {
    __m256 acc[8];
    for (auto& x : acc) x = _mm256_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      for (int zi = 0; zi < Z; ++zi) {
        const __m256 f = _mm256_loadu_ps(f1 + (v * Z + zi) * 8);
        for (int i = 0; i < kShifts; ++i) {
          const __m256 f2v = a0 + i < A ? _mm256_loadu_ps(f2 + (v * kMaxShifts + a0 + i) * 8)
                                        : _mm256_setzero_ps();
          acc[i * Z + zi] = _mm256_fmadd_ps(f2v, f, acc[i * Z + zi]);
        }
      }
    }
    add_sums(acc, std::min<int64_t>(8, (A - a0) * Z), out + a0 * Z);
  }
}

// block_backward on 16 lanes (AVX-512: 16 triples per vector), the same
// operations lane by lane, so the same bits; the block is padded to a
// multiple of 16 (list_triples).
template <int Z>
TF_AVX512 void block_backward512(CentreScratch& w, const CentreScratch::Block& b,
                                 const Consts<float>& k, const float* g) {
  const int64_t A = k.A;
  const __m512 two = _mm512_set1_ps(2.0f), half = _mm512_set1_ps(0.5f);
  const __m512 shrink = _mm512_set1_ps(0.95f), big = _mm512_set1_ps(1e10f);
  for (int64_t t = b.begin; t < b.begin + b.count; t += 16) {
    const __m512 m = load16(w.mean_r, t);
    __m512 g2[Z], gd2[Z];
    for (int zi = 0; zi < Z; ++zi) g2[zi] = gd2[zi] = _mm512_setzero_ps();
    __m512 x[kMaxShifts], f2[kMaxShifts];
    radial_factors(k, m, x, f2);
    for (int64_t a = 0; a < A; ++a) {
      const __m512 neg_eta = _mm512_set1_ps(-k.eta_a[a]);
      const __m512 df2 = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(neg_eta, neg_eta), x[a]), f2[a]);
      for (int zi = 0; zi < Z; ++zi) {
        const __m512 gz = _mm512_set1_ps(g[a * Z + zi]);
        g2[zi] = _mm512_fmadd_ps(gz, f2[a], g2[zi]);
        gd2[zi] = _mm512_fmadd_ps(gz, df2, gd2[zi]);
      }
    }
    const __m512 c = load16(w.c, t), s = load16(w.sin_c, t);
    const __m512 c_over_s = _mm512_div_ps(c, s);
    __m512 s_val = _mm512_setzero_ps(), s_dc = _mm512_setzero_ps(), s_dm = _mm512_setzero_ps();
    __m512 base[Z], p[Z];  // p = base^(zeta - 1): f1 = 2 p base
    section_powers(k, c, s, 1.0f, base, p);
    for (int zi = 0; zi < Z; ++zi) {
      const __m512 cos_z = _mm512_set1_ps(k.cos_z[zi]), sin_z = _mm512_set1_ps(k.sin_z[zi]);
      const __m512 f1 = _mm512_mul_ps(_mm512_mul_ps(two, p[zi]), base[zi]);
      const __m512 df1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(k.zeta[zi]), p[zi]),
                                       _mm512_fnmadd_ps(c_over_s, sin_z, cos_z));
      s_val = _mm512_fmadd_ps(g2[zi], f1, s_val);
      s_dc = _mm512_fmadd_ps(g2[zi], df1, s_dc);
      s_dm = _mm512_fmadd_ps(gd2[zi], f1, s_dm);
    }
    const __m512 fc1 = load16(w.fc1, t), fc2 = load16(w.fc2, t);
    const __m512 inv1 = load16(w.inv1, t), inv2 = load16(w.inv2, t);
    const __m512 fcc = load16(w.fcc, t);
    const __m512 d_cos = _mm512_mul_ps(_mm512_mul_ps(shrink, fcc), s_dc);
    const __m512 d_m = _mm512_mul_ps(_mm512_mul_ps(half, fcc), s_dm);
    const __m512 d_r1 = _mm512_fmadd_ps(_mm512_mul_ps(s_val, load16(w.dfc1, t)), fc2, d_m);
    const __m512 d_r2 = _mm512_fmadd_ps(_mm512_mul_ps(s_val, fc1), load16(w.dfc2, t), d_m);
    const __m512 c1 = _mm512_mul_ps(d_r1, inv1), c2 = _mm512_mul_ps(d_r2, inv2);
    const __m512 dq = _mm512_mul_ps(d_cos, load16(w.q, t));
    const __mmask16 clamped = _mm512_movepi32_mask(_mm512_castps_si512(load16(w.clamped, t)));
    _mm512_storeu_ps(w.c12.data() + t, _mm512_mask_blend_ps(clamped, _mm512_mul_ps(_mm512_mul_ps(d_cos, inv1), inv2),
                                                            _mm512_mul_ps(d_cos, big)));
    _mm512_storeu_ps(w.c1.data() + t,
                     _mm512_mask_blend_ps(clamped, _mm512_fnmadd_ps(_mm512_mul_ps(dq, inv1), inv1, c1), c1));
    _mm512_storeu_ps(w.c2.data() + t,
                     _mm512_mask_blend_ps(clamped, _mm512_fnmadd_ps(_mm512_mul_ps(dq, inv2), inv2, c2), c2));
  }
}

// radial_forward with its exp on 16 lanes (AVX-512: two vectors of 8
// neighbours at a time) and its sums on 8, in radial_forward's order: the
// same bits.
TF_AVX512 void radial_forward512(const NeighborArrays& nb, const Consts<float>& k, float* row) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 quarter = _mm512_set1_ps(0.25f);
  for (int64_t s = 0; s < k.S; ++s) {
    const int64_t b = nb.seg[s], e = nb.seg[s + 1];
    if (b == e) continue;
    for (int64_t q = 0; q < k.R; q += 8) {
      __m256 acc[8];
      for (auto& x : acc) x = _mm256_setzero_ps();
      for (int64_t v = b; v < e; v += 16) {
        const __m512 r = _mm512_loadu_ps(nb.r.data() + v);
        // lanes past the species' last neighbour add nothing
        const __mmask16 in = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(e - v)), lane);
        const __m512 scale = _mm512_maskz_mul_ps(in, quarter, _mm512_loadu_ps(nb.fc.data() + v));
        const __m256 scale_lo = _mm512_castps512_ps256(scale), scale_hi = _mm512_extractf32x8_ps(scale, 1);
        const bool hi = v + 8 < e;
        __m512 t[8];
        for (int i = 0; i < 8; ++i) {
          const __m512 x = _mm512_sub_ps(r, _mm512_set1_ps(k.shf_r[q + i]));
          t[i] = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(-k.eta_r[q + i]), x), x);
        }
        simd::exp_n(t, t);
        for (int i = 0; i < 8; ++i) {
          acc[i] = _mm256_fmadd_ps(_mm512_castps512_ps256(t[i]), scale_lo, acc[i]);
          if (hi) acc[i] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(t[i], 1), scale_hi, acc[i]);
        }
      }
      float* out = row + s * k.R + q;
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), sums8(acc)));
    }
  }
}

// radial_backward on 16 lanes (AVX-512: 16 neighbours per vector), the same
// operations lane by lane, so the same bits.
TF_AVX512 void radial_backward512(const NeighborArrays& nb, const Consts<float>& k, const float* grow,
                                  std::vector<float>& coef, float* grad_edge) {
  coef.resize(nb.n + NeighborArrays::kPad);
  const __m512 quarter = _mm512_set1_ps(0.25f), half = _mm512_set1_ps(0.5f);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t s = 0; s < k.S; ++s) {
    const float* g = grow + s * k.R;
    for (int64_t v = nb.seg[s]; v < nb.seg[s + 1]; v += 16) {
      const __m512 r = _mm512_loadu_ps(nb.r.data() + v);
      __m512 sum_e = zero, sum_et = zero;
      for (int64_t q0 = 0; q0 < k.R; q0 += 8) {  // (R is a multiple of 8)
        __m512 t[8], e[8];
        for (int i = 0; i < 8; ++i) {
          const __m512 x = _mm512_sub_ps(r, _mm512_set1_ps(k.shf_r[q0 + i]));
          t[i] = _mm512_mul_ps(_mm512_set1_ps(k.eta_r[q0 + i]), x);
          e[i] = _mm512_fnmadd_ps(t[i], x, zero);
        }
        simd::exp_n(e, e);
        for (int i = 0; i < 8; ++i) {
          const __m512 ge = _mm512_mul_ps(_mm512_set1_ps(g[q0 + i]), e[i]);
          sum_e = _mm512_add_ps(sum_e, ge);
          sum_et = _mm512_fmadd_ps(ge, t[i], sum_et);
        }
      }
      const __m512 fc = _mm512_loadu_ps(nb.fc.data() + v), dfc = _mm512_loadu_ps(nb.dfc.data() + v);
      const __m512 d = _mm512_fmsub_ps(_mm512_mul_ps(quarter, dfc), sum_e,
                                       _mm512_mul_ps(_mm512_mul_ps(half, fc), sum_et));
      _mm512_storeu_ps(coef.data() + v, _mm512_mul_ps(d, _mm512_loadu_ps(nb.inv_r.data() + v)));
    }
  }
  add_radial_edges(nb, coef, grad_edge);
}
