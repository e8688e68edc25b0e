// The vectorised CPU AEV in float64: the per-centre scratch, and the pieces
// that both widths share. The sums over several neighbours or triples (the
// forward's AEV terms, the backward's neighbour table) run here, on 4 lanes
// in one order, for the 4-lane (AVX2) and the 8-lane (AVX-512) kernels
// alike, so that both give the same bits.
#pragma once
// (Included by aev/vector_f64_cpu.cpp only, inside its TF_SIMD_AVX2 block and
// anonymous namespace: these are that one translation unit's pieces.)

// The neighbours of one centre, sorted by species (stably), as structures of
// arrays with 8 entries of padding after the last (read by partly used
// vectors, whose extra lanes are masked or multiplied by 0): all of them
// (radial terms), and again those within the angular cutoff, each with its
// cutoff (and for the backward its derivative, and 1 / r, 0 at r = 0).
struct NeighborsF64 {
  std::vector<double> x, y, z, r, fc, dfc, inv_r;
  std::vector<int64_t> edge;  // the half edge of each
  std::vector<int64_t> seg;   // (S + 1,) first neighbour of each species
  int64_t n = 0;
  static constexpr int64_t kPad = 8;

  // The first n entries are all written before they are read; only the
  // padding is zeroed here (the memory is reused from centre to centre).
  void resize(int64_t count, int64_t S) {
    n = count;
    for (auto* v : {&x, &y, &z, &r, &fc, &dfc, &inv_r}) {
      if (v->size() < static_cast<size_t>(n + kPad)) v->resize(n + kPad);
      std::fill_n(v->data() + n, kPad, 0.0);
    }
    edge.resize(n + kPad);
    seg.assign(S + 1, 0);
  }
};

// Per-thread scratch of one centre's terms, reused from atom to atom: the
// float32 CentreScratch's arrays in float64 (aev/vector_common.h), the
// clamped flag as 1.0 / 0.0.
struct ScratchF64 {
  NeighborsF64 all, ang;
  std::vector<double> c, sin_c, mean_r, fcc;
  std::vector<double> q, clamped, fc1, fc2, dfc1, dfc2, inv1, inv2, c12, c1, c2;
  std::vector<int32_t> j, l;
  struct Block {
    int64_t pair, begin, count;
  };
  std::vector<Block> blocks;
  std::vector<double> f;     // forward: one block's f1 fcc (Z, T) and f2 (A, T), T its padded size
  std::vector<double> pair;  // backward: (n, n4) coefficients of the neighbours' vectors
  std::vector<double> diag;  // backward: (n,) coefficient of each neighbour's own vector
  std::vector<double> coef;  // backward: (n + 8,) radial terms' coefficient of each neighbour
};

constexpr int kMaxShiftsF64 = 8;  // (A <= 8: vector_path)

// all sized for centre i's half edges, with their species segments; returns
// the first half edge's vector.
inline const double* centre_edges(const HalfEdges& h, int64_t i, const Consts<double>& k,
                                  NeighborsF64& all) {
  const int64_t e0 = h.start[i];
  all.resize(h.start[i + 1] - e0, k.S);
  for (int64_t s = 0; s <= k.S; ++s) all.seg[s] = h.seg[i * k.S + s] - e0;
  return h.vec64.data() + 4 * e0;
}

// The horizontal sums of a, b, c, d (in this order), each (x0 + x1) + (x2 + x3).
TF_AVX2_INLINE __m256d hsums4(__m256d a, __m256d b, __m256d c, __m256d d) {
  const __m256d ab = _mm256_hadd_pd(a, b), cd = _mm256_hadd_pd(c, d);
  return _mm256_add_pd(_mm256_permute2f128_pd(ab, cd, 0x20), _mm256_permute2f128_pd(ab, cd, 0x31));
}

// The 8 sums of acc added to o[0 .. valid).
TF_AVX2_INLINE void add_sums(const __m256d* acc, int64_t valid, double* o) {
  alignas(32) double s[8];
  _mm256_store_pd(s, hsums4(acc[0], acc[1], acc[2], acc[3]));
  _mm256_store_pd(s + 4, hsums4(acc[4], acc[5], acc[6], acc[7]));
  for (int64_t e = 0; e < valid; ++e) o[e] += s[e];
}

// One block's AEV terms added to its AEV block `out` (A x Z, z fastest) from
// f1 fcc (Z, T) and f2 (A, T) of its triples: per pass 8 / Z shifts, one
// accumulator per term, 4 triples per vector.
template <int Z>
TF_AVX2 void block_sums(const double* f1, const double* f2, int64_t T, int64_t count, int64_t A,
                        double* out) {
  constexpr int kShifts = 8 / Z;
  const int64_t vectors = (count + 3) / 4;
  for (int64_t a0 = 0; a0 < A; a0 += kShifts) {
    __m256d acc[8];
    for (auto& x : acc) x = _mm256_setzero_pd();
    for (int64_t v = 0; v < vectors; ++v) {
      __m256d f2v[kShifts];
      for (int i = 0; i < kShifts; ++i)
        f2v[i] = a0 + i < A ? _mm256_loadu_pd(f2 + (a0 + i) * T + 4 * v) : _mm256_setzero_pd();
      for (int zi = 0; zi < Z; ++zi) {
        const __m256d f = _mm256_loadu_pd(f1 + zi * T + 4 * v);
        for (int i = 0; i < kShifts; ++i) acc[i * Z + zi] = _mm256_fmadd_pd(f2v[i], f, acc[i * Z + zi]);
      }
    }
    add_sums(acc, std::min<int64_t>(8, (A - a0) * Z), out + a0 * Z);
  }
}

// Each angular neighbour's gradient: its row of the (neighbour x neighbour)
// table times the neighbours' vectors, plus its own coefficient times its
// vector, added to its half edge.
TF_AVX2 void add_table_grads(const ScratchF64& w, double* grad_edge) {
  const NeighborsF64& ang = w.ang;
  const int64_t n = ang.n, n4 = (n + 3) / 4 * 4;
  for (int64_t j = 0; j < n; ++j) {
    const double* row = w.pair.data() + j * n4;
    __m256d gx = _mm256_setzero_pd(), gy = _mm256_setzero_pd(), gz = _mm256_setzero_pd();
    for (int64_t l = 0; l < n4; l += 4) {
      const __m256d p = _mm256_loadu_pd(row + l);
      gx = _mm256_fmadd_pd(p, _mm256_loadu_pd(ang.x.data() + l), gx);
      gy = _mm256_fmadd_pd(p, _mm256_loadu_pd(ang.y.data() + l), gy);
      gz = _mm256_fmadd_pd(p, _mm256_loadu_pd(ang.z.data() + l), gz);
    }
    alignas(32) double s[4];
    _mm256_store_pd(s, hsums4(gx, gy, gz, _mm256_setzero_pd()));
    double* ge = grad_edge + 3 * ang.edge[j];
    ge[0] += s[0] + w.diag[j] * ang.x[j];
    ge[1] += s[1] + w.diag[j] * ang.y[j];
    ge[2] += s[2] + w.diag[j] * ang.z[j];
  }
}

// Each neighbour's radial coefficient times its vector, added to its half edge.
inline void add_radial_edges(const NeighborsF64& nb, const std::vector<double>& coef,
                             double* grad_edge) {
  for (int64_t e = 0; e < nb.n; ++e) {
    double* ge = grad_edge + 3 * nb.edge[e];
    ge[0] += coef[e] * nb.x[e];
    ge[1] += coef[e] * nb.y[e];
    ge[2] += coef[e] * nb.z[e];
  }
}

// Prefetch the parts of atom i's AEV gradient row that its backward reads
// (as the float32 prefetch_grad_row: the row comes mostly out of the caches).
inline void prefetch_grad_row_f64(const HalfEdges& h, int64_t i, const Consts<double>& k,
                                  const double* grow) {
  const auto lines = [](const void* p, int64_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
    const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
    for (uintptr_t a = first; a < end; a += 64) _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
  };
  const int64_t* seg = h.seg.data() + i * k.S;
  const int64_t block = k.A * k.Z;
  for (int64_t s1 = 0; s1 < k.S; ++s1) {
    if (seg[s1 + 1] == seg[s1]) continue;
    lines(grow + s1 * k.R, 8 * k.R);
    for (int64_t s2 = s1; s2 < k.S; ++s2)
      if (seg[s2 + 1] > seg[s2]) lines(grow + k.radial_len + k.pair_index(s1, s2) * block, 8 * block);
  }
}
