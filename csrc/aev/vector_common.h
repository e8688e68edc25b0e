// The vectorised CPU AEV (float32): the per-centre scratch structures and the
// 8-lane helpers that both instruction sets use.
#pragma once
// (Included by aev/vector_cpu.cpp only, inside its TF_SIMD_AVX2 block and
// anonymous namespace: these are that one translation unit's pieces.)

// The neighbours of one centre, sorted by species (stably), as structures of
// arrays with 16 entries of padding after the last (read by partly used
// vectors of 8 or 16 lanes, whose extra lanes are masked or overwritten): all
// of them (radial terms), and again those within the angular cutoff, each
// with its cutoff (and for the backward its derivative, and 1 / r, 0 at r = 0).
struct NeighborArrays {
  std::vector<float> x, y, z, r, fc, dfc, inv_r;
  std::vector<int64_t> edge;  // the half edge of each (and 16 entries of scratch)
  std::vector<int64_t> seg;   // (S + 1,) first neighbour of each species
  int64_t n = 0;
  static constexpr int64_t kPad = 16;

  // The first n entries are all written before they are read; only the
  // padding is zeroed here (the memory is reused from centre to centre).
  void resize(int64_t count, int64_t S) {
    n = count;
    for (auto* v : {&x, &y, &z, &r, &fc, &dfc, &inv_r}) {
      if (v->size() < static_cast<size_t>(n + kPad)) v->resize(n + kPad);
      std::fill_n(v->data() + n, kPad, 0.0f);
    }
    edge.resize(n + kPad);
    seg.assign(S + 1, 0);
  }
  // fc (and dfc, inv_r) of every neighbour for the cutoff rc.
  TF_AVX2 void cutoffs(float rc, bool backward, const aev_math::CutoffFn<float>& fn) {
    if (fn.kind == aev_math::kCutoffSmooth) return smooth_cutoffs(rc, backward, fn);
    const __m256 w = _mm256_set1_ps(static_cast<float>(aev_math::kPi) / rc);
    const __m256 half = _mm256_set1_ps(0.5f), neg_half_w = _mm256_mul_ps(_mm256_set1_ps(-0.5f), w);
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 cut = _mm256_set1_ps(rc), half_w = _mm256_mul_ps(half, w);
    for (int64_t e = 0; e < n; e += 8) {
      const __m256 rr = _mm256_loadu_ps(r.data() + e);
      __m256 c, s;
      simd::cos_sin_0_pi(_mm256_mul_ps(rr, w), c, s);
      // aev_math::cutoff_tail: where fc rounds to 0 below rc, (pi (rc - r) / (2 rc))^2.
      const __m256 f = _mm256_fmadd_ps(half, c, half);
      const __m256 tail = _mm256_and_ps(_mm256_cmp_ps(f, zero, _CMP_EQ_OQ),
                                        _mm256_cmp_ps(rr, cut, _CMP_LT_OQ));
      const __m256 t = _mm256_mul_ps(_mm256_sub_ps(cut, rr), half_w);
      _mm256_storeu_ps(fc.data() + e, _mm256_blendv_ps(f, _mm256_mul_ps(t, t), tail));
      if (!backward) continue;
      _mm256_storeu_ps(dfc.data() + e, _mm256_mul_ps(neg_half_w, s));
      const __m256 positive = _mm256_cmp_ps(rr, zero, _CMP_GT_OQ);
      _mm256_storeu_ps(inv_r.data() + e, _mm256_and_ps(_mm256_div_ps(one, rr), positive));
    }
  }
  // aev_math::smooth_parts on 8 lanes, the same operations (the exp is
  // simd::exp): fc = exp(1 - 1/u), u = max(eps, 1 - (r/rc)^n), and dfc = fc g,
  // g = -n (r/rc)^(n-1) / (rc u^2) where u >= eps, else 0.
  TF_AVX2 void smooth_cutoffs(float rc, bool backward, const aev_math::CutoffFn<float>& fn) {
    const __m256 cut = _mm256_set1_ps(rc), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 eps = _mm256_set1_ps(fn.eps), neg_n = _mm256_set1_ps(-static_cast<float>(fn.order));
    for (int64_t e = 0; e < n; e += 8) {
      const __m256 rr = _mm256_loadu_ps(r.data() + e);
      const __m256 x = _mm256_div_ps(rr, cut);
      __m256 xn1 = one;  // x^(n-1)
      for (int64_t j = 1; j < fn.order; ++j) xn1 = j == 1 ? x : _mm256_mul_ps(xn1, x);
      const __m256 xn = fn.order == 1 ? x : _mm256_mul_ps(xn1, x);
      const __m256 u0 = _mm256_sub_ps(one, xn);
      const __m256 free = _mm256_cmp_ps(u0, eps, _CMP_GE_OQ);
      const __m256 u = _mm256_blendv_ps(eps, u0, free);
      const __m256 f = simd::exp(_mm256_sub_ps(one, _mm256_div_ps(one, u)));
      _mm256_storeu_ps(fc.data() + e, f);
      if (!backward) continue;
      const __m256 g = _mm256_div_ps(_mm256_mul_ps(neg_n, xn1), _mm256_mul_ps(_mm256_mul_ps(cut, u), u));
      _mm256_storeu_ps(dfc.data() + e, _mm256_mul_ps(f, _mm256_and_ps(g, free)));
      const __m256 positive = _mm256_cmp_ps(rr, zero, _CMP_GT_OQ);
      _mm256_storeu_ps(inv_r.data() + e, _mm256_and_ps(_mm256_div_ps(one, rr), positive));
    }
  }
};

// Per-thread scratch of one centre's terms, reused from atom to atom.
struct CentreScratch {
  NeighborArrays all, ang;
  // Triples, block after block, each block padded to a multiple of 8 (16 on
  // the 16-lane path).
  // Forward and backward: c = 0.95 cos, sqrt(1 - c^2), the mean distance and
  // fc1 fc2. Backward also: cos (unclamped), whether the product r1 r2 was
  // clamped (a lane mask), the two neighbours' cutoffs, cutoff derivatives and
  // 1 / r, their indices, and the triple's gradient coefficients (c12, c1, c2;
  // see block_backward).
  std::vector<float> c, sin_c, mean_r, fcc;
  std::vector<float> q, clamped, fc1, fc2, dfc1, dfc2, inv1, inv2, c12, c1, c2;
  std::vector<int32_t> j, l;
  struct Block {
    int64_t pair, begin, count;
  };
  std::vector<Block> blocks;
  std::vector<float> f1;    // forward: f1 fcc per triple and section
  std::vector<float> pair;  // backward: (n, n8) coefficients of the neighbours' vectors
  std::vector<float> diag;  // backward: (n,) coefficient of each neighbour's own vector
  std::vector<float> coef;  // backward: (n + 8,) radial terms' coefficient of each neighbour
};

// all sized for centre i's half edges, with their species segments; returns
// the first half edge's vector.
TF_AVX2_INLINE const float* centre_edges(const HalfEdges& h, int64_t i, const Consts<float>& k,
                                         NeighborArrays& all) {
  const int64_t e0 = h.start[i];
  all.resize(h.start[i + 1] - e0, k.S);
  for (int64_t s = 0; s <= k.S; ++s) all.seg[s] = h.seg[i * k.S + s] - e0;
  return h.vec.data() + 4 * e0;
}

TF_AVX2_INLINE void store_at(std::vector<float>& v, int64_t t, __m256 x) {
  _mm256_storeu_ps(v.data() + t, x);
}

// Per-lane constants of the angular terms.
struct AngularConsts {
  __m256 shf[8], neg_eta[8];               // per shift a
  __m256 cos_z[8], sin_z[8], zeta[8], zeta_m1[8];  // per section z
  TF_AVX2 explicit AngularConsts(const Consts<float>& k) {
    for (int64_t a = 0; a < k.A; ++a) {
      shf[a] = _mm256_set1_ps(k.shf_a[a]);
      neg_eta[a] = _mm256_set1_ps(-k.eta_a[a]);
    }
    for (int64_t s = 0; s < k.Z; ++s) {
      cos_z[s] = _mm256_set1_ps(k.cos_z[s]);
      sin_z[s] = _mm256_set1_ps(k.sin_z[s]);
      zeta[s] = _mm256_set1_ps(k.zeta[s]);
      zeta_m1[s] = _mm256_set1_ps(k.zeta[s] - 1.0f);
    }
  }
};

constexpr int kMaxShifts = 8;  // (A <= 8: vector_path)

// The 8 horizontal sums of v[0..8), in order.
TF_AVX2_INLINE __m256 sums8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The 8 sums of acc added to o[0 .. valid) (valid < 8: a pass of shifts that
// runs past the last one).
TF_AVX2_INLINE void add_sums(const __m256* acc, int64_t valid, float* o) {
  const __m256 sums = sums8(acc);
  if (valid == 8) {
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), sums));
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, sums);
    for (int64_t e = 0; e < valid; ++e) o[e] += tmp[e];
  }
}

// Each neighbour's radial coefficient times its vector, added to its half edge.
inline void add_radial_edges(const NeighborArrays& nb, const std::vector<float>& coef,
                             float* grad_edge) {
  for (int64_t e = 0; e < nb.n; ++e) {
    float* ge = grad_edge + 3 * nb.edge[e];
    ge[0] += coef[e] * nb.x[e];
    ge[1] += coef[e] * nb.y[e];
    ge[2] += coef[e] * nb.z[e];
  }
}

// Prefetch the cache lines of the bytes [p, p + bytes) into L1.
inline void prefetch_lines(const void* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  for (uintptr_t a = first; a < end; a += 64) _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}

// Prefetch the parts of atom i's AEV gradient row that its backward reads:
// the radial block of each species among its neighbours, and the angular
// block of each pair of them (the row comes from the networks' backward,
// mostly out of the caches: read cold, these lines kept the backward waiting).
inline void prefetch_grad_row(const HalfEdges& h, int64_t i, const Consts<float>& k,
                              const float* grow) {
  const int64_t* seg = h.seg.data() + i * k.S;
  const int64_t block = k.A * k.Z;
  for (int64_t s1 = 0; s1 < k.S; ++s1) {
    if (seg[s1 + 1] == seg[s1]) continue;
    prefetch_lines(grow + s1 * k.R, 4 * k.R);
    for (int64_t s2 = s1; s2 < k.S; ++s2)
      if (seg[s2 + 1] > seg[s2])
        prefetch_lines(grow + k.radial_len + k.pair_index(s1, s2) * block, 4 * block);
  }
}
