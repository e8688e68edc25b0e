// CPU AEV from a half neighbour list: forward and backward, parallel over atoms.
//
// Each pair p = (i0, i1) with diff_vectors[p] = x[i0] - x[i1] (+ lattice shift)
// is expanded into two "half edges", one owned by each atom. An atom only ever
// writes its own AEV row (forward) and the gradients of its own half edges
// (backward), so the parallel loop over atoms needs no atomics and gives the same
// bits for any number of threads.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "aev_cpu_common.h"
#include "output_cache.h"
#include "simd_math.h"

namespace torchani_fast {

using namespace aev_cpu_detail;

namespace {

// The angular cutoff of each angular neighbour; for the backward (dfc and
// inv_r given, else both null) also its derivative and 1 / r (0 for r = 0), so
// that a triple's gradient needs no division.
template <typename scalar_t>
inline void angular_cutoffs(const std::vector<Neighbor<scalar_t>>& ang, scalar_t rc,
                            std::vector<scalar_t>& fc, std::vector<scalar_t>* dfc,
                            std::vector<scalar_t>* inv_r) {
  fc.resize(ang.size());
  for (size_t j = 0; j < ang.size(); ++j) fc[j] = cutoff_cos(ang[j].r, rc);
  if (dfc == nullptr) return;
  dfc->resize(ang.size());
  inv_r->resize(ang.size());
  for (size_t j = 0; j < ang.size(); ++j) {
    (*dfc)[j] = cutoff_cos_deriv(ang[j].r, rc);
    (*inv_r)[j] = ang[j].r > 0 ? scalar_t(1) / ang[j].r : scalar_t(0);
  }
}

// The gradient of one angular triple on its two half edges, from the sums over
// its AEV block (g = grad_aev): s_val = sum g f, s_dc = sum g df/dc and
// s_dm = sum g df/d(mean r) without the cutoffs; fc1, fc2, dfc1, dfc2 and
// inv1, inv2 are the two neighbours' angular cutoffs, their derivatives and 1 / r.
template <typename scalar_t>
inline void add_triple_grad(const Neighbor<scalar_t>& n1, const Neighbor<scalar_t>& n2,
                            const aev_math::Triple<scalar_t>& t, scalar_t fc1, scalar_t fc2,
                            scalar_t dfc1, scalar_t dfc2, scalar_t inv1, scalar_t inv2,
                            scalar_t s_val, scalar_t s_dc, scalar_t s_dm, scalar_t* grad_edge) {
  const scalar_t fcc = fc1 * fc2;
  // d/d(cos_raw) through c = 0.95 cos_raw; d/dr_i through the mean distance
  // (factor 1/2) and through the cutoff of that neighbour.
  const scalar_t d_cos = scalar_t(0.95) * fcc * s_dc;
  const scalar_t d_r1 = scalar_t(0.5) * fcc * s_dm + s_val * dfc1 * fc2;
  const scalar_t d_r2 = scalar_t(0.5) * fcc * s_dm + s_val * fc1 * dfc2;
  // g1 = d_cos dq/dv1 + d_r1 v1 / r1 with dq/dv1 = v2 / (r1 r2) - q v1 / r1^2
  // (q = cos_raw; v2 1e10 once clamped), as coefficients of v1 and v2.
  scalar_t c12, c1 = d_r1 * inv1, c2 = d_r2 * inv2;
  if (t.clamped) {
    c12 = d_cos * scalar_t(1e10);
  } else {
    c12 = d_cos * inv1 * inv2;
    c1 -= d_cos * t.cos_raw * inv1 * inv1;
    c2 -= d_cos * t.cos_raw * inv2 * inv2;
  }
  scalar_t* g1 = grad_edge + 3 * n1.edge;
  scalar_t* g2 = grad_edge + 3 * n2.edge;
  for (int c = 0; c < 3; ++c) {
    g1[c] += c12 * n2.v[c] + c1 * n1.v[c];
    g2[c] += c12 * n1.v[c] + c2 * n2.v[c];
  }
}

#ifdef TF_SIMD_AVX2
// float32 when R is a multiple of 8, A <= 8 and Z divides 8 with A Z a multiple
// of 8 (every ANI model: ANI-1x A = 4, Z = 8; ANI-2x A = 8, Z = 4): the per-term
// loops on 8 lanes with simd::exp / simd::log, the same neighbours, triples and
// accumulation order per atom as the scalar kernels. An angular block (A x Z,
// z fastest) is A Z / 8 vectors; lane l of every one of them has z = l % Z, so
// the section factor f1(z) is one vector for them all, and the radial factor
// f2(a), computed once on A lanes, is spread to each by a lane permutation.
bool vector_path(const Consts<float>& k) {
  return simd::have_avx2() && k.R % 8 == 0 && k.A <= 8 && 8 % k.Z == 0 && (k.A * k.Z) % 8 == 0;
}

struct AngularLanes {
  __m256 cos_z, sin_z, zeta;  // lane l: section l % Z
  __m256 shf, neg_eta;        // lane a < A: shift a and -eta_a (0 beyond A)
  __m256i spread[8];          // vector v of a block, lane l: a = (8 v + l) / Z
  int64_t vectors;            // A Z / 8
  TF_AVX2 explicit AngularLanes(const Consts<float>& k) {
    alignas(32) float cz[8], sz[8], ze[8], shf_a[8] = {}, eta_a[8] = {};
    alignas(32) int32_t idx[8];
    for (int l = 0; l < 8; ++l) {
      cz[l] = k.cos_z[l % k.Z];
      sz[l] = k.sin_z[l % k.Z];
      ze[l] = k.zeta[l % k.Z];
    }
    for (int64_t a = 0; a < k.A; ++a) {
      shf_a[a] = k.shf_a[a];
      eta_a[a] = -k.eta_a[a];
    }
    cos_z = _mm256_load_ps(cz);
    sin_z = _mm256_load_ps(sz);
    zeta = _mm256_load_ps(ze);
    shf = _mm256_load_ps(shf_a);
    neg_eta = _mm256_load_ps(eta_a);
    vectors = k.A * k.Z / 8;
    for (int64_t v = 0; v < vectors; ++v) {
      for (int l = 0; l < 8; ++l) idx[l] = static_cast<int32_t>((8 * v + l) / k.Z);
      spread[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    }
  }
};

// One angular triple of an atom: its two neighbours (indices into the angular
// neighbours) and the parts shared by its terms.
struct TripleRef {
  size_t j, l;
  aev_math::Triple<float> t;
};

// The angular triples of one atom, in the order their terms are added.
inline void collect_triples(const std::vector<Neighbor<float>>& ang, std::vector<TripleRef>& out) {
  out.clear();
  for (size_t j = 0; j < ang.size(); ++j)
    for (size_t l = j + 1; l < ang.size(); ++l) out.push_back({j, l, make_triple(ang[j], ang[l])});
}

// Lanes 0-3 = a, 4-7 = b: the section factors of two triples in one vector when
// Z = 4 (ANI-2x), so one log and one exp serve both. Lane for lane the same
// arithmetic as a broadcast of each, hence the same bits.
TF_AVX2_INLINE __m256 halves(float a, float b) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(a)), _mm_set1_ps(b), 1);
}
TF_AVX2_INLINE __m256 low_half_twice(__m256 v) { return _mm256_permute2f128_ps(v, v, 0x00); }
TF_AVX2_INLINE __m256 high_half_twice(__m256 v) { return _mm256_permute2f128_ps(v, v, 0x11); }

// (1 + cos(acos(c) - ts)) / 2 per lane (section l % Z), from c and sqrt(1 - c^2).
TF_AVX2_INLINE __m256 section_base(const AngularLanes& lanes, __m256 c, __m256 sin_c) {
  const __m256 cdev = _mm256_fmadd_ps(c, lanes.cos_z, _mm256_mul_ps(sin_c, lanes.sin_z));
  return _mm256_mul_ps(_mm256_add_ps(_mm256_set1_ps(1.0f), cdev), _mm256_set1_ps(0.5f));
}

// f1 = 2 base^zeta per lane.
TF_AVX2_INLINE __m256 section_factor(const AngularLanes& lanes, __m256 c, __m256 sin_c) {
  const __m256 base = section_base(lanes, c, sin_c);
  return _mm256_mul_ps(_mm256_set1_ps(2.0f), simd::exp(_mm256_mul_ps(lanes.zeta, simd::log(base))));
}

// f1 and df1/dc per lane; c_over_s = c / sqrt(1 - c^2).
TF_AVX2_INLINE void section_parts(const AngularLanes& lanes, __m256 c, __m256 sin_c, __m256 c_over_s,
                                  __m256& f1, __m256& df1) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 base = section_base(lanes, c, sin_c);
  // p = base^(zeta - 1): f1 = 2 p base, df1/dc = zeta p dcdev/dc
  const __m256 p = simd::exp(_mm256_mul_ps(_mm256_sub_ps(lanes.zeta, one), simd::log(base)));
  f1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(2.0f), p), base);
  // d cos(acos(c) - ts)/dc = cos(ts) - c / sqrt(1 - c^2) * sin(ts)
  const __m256 dcdev = _mm256_fnmadd_ps(c_over_s, lanes.sin_z, lanes.cos_z);
  df1 = _mm256_mul_ps(_mm256_mul_ps(lanes.zeta, p), dcdev);
}

// One triple's terms added to its AEV block: f1 (per lane) times f2(mean r) fc1 fc2.
TF_AVX2_INLINE void add_triple_aev(const AngularLanes& lanes, const Consts<float>& k, float* row,
                                   const std::vector<Neighbor<float>>& ang,
                                   const std::vector<float>& fc_a, const TripleRef& tr, __m256 f1) {
  const __m256 x = _mm256_sub_ps(_mm256_set1_ps(tr.t.mean_r), lanes.shf);
  const __m256 f2 = _mm256_mul_ps(simd::exp(_mm256_mul_ps(_mm256_mul_ps(lanes.neg_eta, x), x)),
                                  _mm256_set1_ps(fc_a[tr.j] * fc_a[tr.l]));
  float* out = row + k.radial_len + k.pair_index(ang[tr.j].species, ang[tr.l].species) * k.A * k.Z;
  for (int64_t v = 0; v < lanes.vectors; ++v) {
    const __m256 f2v = _mm256_permutevar8x32_ps(f2, lanes.spread[v]);
    _mm256_storeu_ps(out + 8 * v, _mm256_fmadd_ps(f2v, f1, _mm256_loadu_ps(out + 8 * v)));
  }
}

// One triple's gradient on its half edges, from f1 and df1/dc per lane.
TF_AVX2_INLINE void add_triple_grad_avx2(const AngularLanes& lanes, const Consts<float>& k,
                                         const float* grow, const std::vector<Neighbor<float>>& ang,
                                         const TripleRef& tr, const std::vector<float>& fc_a,
                                         const std::vector<float>& dfc_a,
                                         const std::vector<float>& inv_r, __m256 f1, __m256 df1,
                                         float* grad_edge) {
  const size_t j = tr.j, l = tr.l;
  const aev_math::Triple<float>& t = tr.t;
  const Neighbor<float>& n1 = ang[j];
  const Neighbor<float>& n2 = ang[l];
  const __m256 x = _mm256_sub_ps(_mm256_set1_ps(t.mean_r), lanes.shf);
  const __m256 f2 = simd::exp(_mm256_mul_ps(_mm256_mul_ps(lanes.neg_eta, x), x));
  const __m256 df2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(lanes.neg_eta, lanes.neg_eta), x), f2);
  const float* g = grow + k.radial_len + k.pair_index(n1.species, n2.species) * k.A * k.Z;
  // g2 = sum over the block of g f2(a), gd2 = sum of g df2(a)/d(mean r), per lane
  __m256 g2 = _mm256_setzero_ps(), gd2 = _mm256_setzero_ps();
  for (int64_t v = 0; v < lanes.vectors; ++v) {
    const __m256 gv = _mm256_loadu_ps(g + 8 * v);
    g2 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(f2, lanes.spread[v]), gv, g2);
    gd2 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(df2, lanes.spread[v]), gv, gd2);
  }
  add_triple_grad(n1, n2, t, fc_a[j], fc_a[l], dfc_a[j], dfc_a[l], inv_r[j], inv_r[l],
                  simd::hsum(_mm256_mul_ps(g2, f1)), simd::hsum(_mm256_mul_ps(g2, df1)),
                  simd::hsum(_mm256_mul_ps(gd2, f1)), grad_edge);
}

TF_AVX2 void forward_atoms_avx2(int64_t begin, int64_t end, const int64_t* species,
                                const float* diff, const HalfEdges& h, const Consts<float>& k,
                                float* aev) {
  std::vector<Neighbor<float>> nbrs, ang;
  std::vector<float> fc_a;
  std::vector<TripleRef> triples;
  const AngularLanes lanes(k);
  const bool paired = k.Z == 4;
  for (int64_t i = begin; i < end; ++i) {
    float* row = aev + i * k.F;
    std::fill(row, row + k.F, 0.0f);  // (the output is allocated uninitialised)
    if (species[i] < 0) continue;
    gather_neighbors(h, i, species, diff, nbrs);
    ang.clear();
    for (const auto& n : nbrs) {
      const __m256 r = _mm256_set1_ps(n.r);
      const __m256 scale = _mm256_set1_ps(0.25f * cutoff_cos(n.r, k.rc_r));
      float* out = row + n.species * k.R;
      for (int64_t s = 0; s < k.R; s += 8) {
        const __m256 x = _mm256_sub_ps(r, _mm256_loadu_ps(k.shf_r.data() + s));
        const __m256 e = simd::exp(_mm256_mul_ps(
            _mm256_mul_ps(_mm256_xor_ps(_mm256_loadu_ps(k.eta_r.data() + s), _mm256_set1_ps(-0.0f)), x), x));
        _mm256_storeu_ps(out + s, _mm256_fmadd_ps(e, scale, _mm256_loadu_ps(out + s)));
      }
      if (n.r <= k.rc_a) ang.push_back(n);
    }
    angular_cutoffs<float>(ang, k.rc_a, fc_a, nullptr, nullptr);
    collect_triples(ang, triples);
    size_t q = 0;
    if (paired) {  // Z = 4: two triples per section-factor vector, still added in order
      for (; q + 1 < triples.size(); q += 2) {
        const TripleRef& a = triples[q];
        const TripleRef& b = triples[q + 1];
        const __m256 f1 = section_factor(lanes, halves(a.t.c, b.t.c), halves(a.t.sin_c, b.t.sin_c));
        add_triple_aev(lanes, k, row, ang, fc_a, a, low_half_twice(f1));
        add_triple_aev(lanes, k, row, ang, fc_a, b, high_half_twice(f1));
      }
    }
    for (; q < triples.size(); ++q) {
      const TripleRef& a = triples[q];
      add_triple_aev(lanes, k, row, ang, fc_a, a,
                     section_factor(lanes, _mm256_set1_ps(a.t.c), _mm256_set1_ps(a.t.sin_c)));
    }
  }
}

TF_AVX2 void backward_atoms_avx2(int64_t begin, int64_t end, const int64_t* species,
                                 const float* diff, const HalfEdges& h, const Consts<float>& k,
                                 const float* grad_aev, float* grad_edge) {
  std::vector<Neighbor<float>> nbrs, ang;
  std::vector<float> fc_a, dfc_a, inv_r;
  std::vector<TripleRef> triples;
  const AngularLanes lanes(k);
  const bool paired = k.Z == 4;
  const __m256 quarter = _mm256_set1_ps(0.25f), neg_zero = _mm256_set1_ps(-0.0f);
  for (int64_t i = begin; i < end; ++i) {
    if (species[i] < 0) continue;
    const float* grow = grad_aev + i * k.F;
    gather_neighbors(h, i, species, diff, nbrs);
    ang.clear();
    for (const auto& n : nbrs) {
      if (n.r <= k.rc_a) ang.push_back(n);
      if (!(n.r > 0)) continue;  // coincident atoms: the direction is undefined
      const __m256 r = _mm256_set1_ps(n.r);
      const __m256 fc = _mm256_set1_ps(cutoff_cos(n.r, k.rc_r));
      const __m256 dfc = _mm256_set1_ps(cutoff_cos_deriv(n.r, k.rc_r));
      const float* g = grow + n.species * k.R;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t s = 0; s < k.R; s += 8) {
        const __m256 eta = _mm256_loadu_ps(k.eta_r.data() + s);
        const __m256 x = _mm256_sub_ps(r, _mm256_loadu_ps(k.shf_r.data() + s));
        const __m256 e = _mm256_mul_ps(quarter, simd::exp(_mm256_mul_ps(_mm256_mul_ps(_mm256_xor_ps(eta, neg_zero), x), x)));
        // d/dr of e fc = e (dfc - 2 eta x fc)
        const __m256 d = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_add_ps(eta, eta), x), fc, dfc);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(g + s), e), d, acc);
      }
      const float dr_r = simd::hsum(acc) / n.r;
      float* ge = grad_edge + 3 * n.edge;
      for (int c = 0; c < 3; ++c) ge[c] += dr_r * n.v[c];
    }
    angular_cutoffs(ang, k.rc_a, fc_a, &dfc_a, &inv_r);
    collect_triples(ang, triples);
    size_t q = 0;
    __m256 f1, df1;
    if (paired) {  // as in forward_atoms_avx2
      for (; q + 1 < triples.size(); q += 2) {
        const TripleRef& a = triples[q];
        const TripleRef& b = triples[q + 1];
        section_parts(lanes, halves(a.t.c, b.t.c), halves(a.t.sin_c, b.t.sin_c),
                      halves(a.t.c / a.t.sin_c, b.t.c / b.t.sin_c), f1, df1);
        add_triple_grad_avx2(lanes, k, grow, ang, a, fc_a, dfc_a, inv_r, low_half_twice(f1),
                             low_half_twice(df1), grad_edge);
        add_triple_grad_avx2(lanes, k, grow, ang, b, fc_a, dfc_a, inv_r, high_half_twice(f1),
                             high_half_twice(df1), grad_edge);
      }
    }
    for (; q < triples.size(); ++q) {
      const TripleRef& a = triples[q];
      section_parts(lanes, _mm256_set1_ps(a.t.c), _mm256_set1_ps(a.t.sin_c),
                    _mm256_set1_ps(a.t.c / a.t.sin_c), f1, df1);
      add_triple_grad_avx2(lanes, k, grow, ang, a, fc_a, dfc_a, inv_r, f1, df1, grad_edge);
    }
  }
}
#endif

template <typename scalar_t>
void forward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                    const Consts<scalar_t>& k, int64_t num_atoms, scalar_t* aev) {
#ifdef TF_SIMD_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (vector_path(k)) {
      at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
        forward_atoms_avx2(begin, end, species, diff, h, k, aev);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), f2(k.A), fc_a;
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* row = aev + i * k.F;
      std::fill(row, row + k.F, scalar_t(0));  // (the output is allocated uninitialised)
      if (species[i] < 0) continue;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        const scalar_t fc = cutoff_cos(n.r, k.rc_r);
        scalar_t* out = row + n.species * k.R;
        for (int64_t s = 0; s < k.R; ++s) {
          const scalar_t x = n.r - k.shf_r[s];
          out[s] += scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x) * fc;
        }
        if (n.r <= k.rc_a) ang.push_back(n);
      }
      angular_cutoffs<scalar_t>(ang, k.rc_a, fc_a, nullptr, nullptr);
      for (size_t j = 0; j < ang.size(); ++j) {
        for (size_t l = j + 1; l < ang.size(); ++l) {
          const auto t = make_triple(ang[j], ang[l]);
          const scalar_t fcc = fc_a[j] * fc_a[l];
          for (int64_t z = 0; z < k.Z; ++z) {
            const scalar_t cdev = t.c * k.cos_z[z] + t.sin_c * k.sin_z[z];
            f1[z] = scalar_t(2) * std::pow((scalar_t(1) + cdev) / scalar_t(2), k.zeta[z]);
          }
          for (int64_t a = 0; a < k.A; ++a) {
            const scalar_t x = t.mean_r - k.shf_a[a];
            f2[a] = std::exp(-k.eta_a[a] * x * x) * fcc;
          }
          scalar_t* out = row + k.radial_len +
                          k.pair_index(ang[j].species, ang[l].species) * k.A * k.Z;
          for (int64_t a = 0; a < k.A; ++a)
            for (int64_t z = 0; z < k.Z; ++z) out[a * k.Z + z] += f2[a] * f1[z];
        }
      }
    }
  });
}

template <typename scalar_t>
void backward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                     const Consts<scalar_t>& k, int64_t num_atoms, const scalar_t* grad_aev,
                     scalar_t* grad_edge) {
#ifdef TF_SIMD_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (vector_path(k)) {
      at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
        backward_atoms_avx2(begin, end, species, diff, h, k, grad_aev, grad_edge);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), df1(k.Z), f2(k.A), df2(k.A), fc_a, dfc_a, inv_r;
    for (int64_t i = begin; i < end; ++i) {
      if (species[i] < 0) continue;
      const scalar_t* grow = grad_aev + i * k.F;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        scalar_t* ge = grad_edge + 3 * n.edge;
        if (n.r <= k.rc_a) ang.push_back(n);
        if (!(n.r > 0)) continue;  // coincident atoms: the direction is undefined
        const scalar_t fc = cutoff_cos(n.r, k.rc_r);
        const scalar_t dfc = cutoff_cos_deriv(n.r, k.rc_r);
        const scalar_t* g = grow + n.species * k.R;
        scalar_t dr = 0;
        for (int64_t s = 0; s < k.R; ++s) {
          const scalar_t x = n.r - k.shf_r[s];
          const scalar_t e = scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x);
          dr += g[s] * e * (dfc - scalar_t(2) * k.eta_r[s] * x * fc);
        }
        const scalar_t dr_r = dr / n.r;
        for (int c = 0; c < 3; ++c) ge[c] += dr_r * n.v[c];
      }
      const size_t na = ang.size();
      angular_cutoffs(ang, k.rc_a, fc_a, &dfc_a, &inv_r);
      for (size_t j = 0; j < na; ++j) {
        for (size_t l = j + 1; l < na; ++l) {
          const auto& n1 = ang[j];
          const auto& n2 = ang[l];
          const auto t = make_triple(n1, n2);
          for (int64_t z = 0; z < k.Z; ++z) {
            const scalar_t cdev = t.c * k.cos_z[z] + t.sin_c * k.sin_z[z];
            const scalar_t base = (scalar_t(1) + cdev) / scalar_t(2);
            f1[z] = scalar_t(2) * std::pow(base, k.zeta[z]);
            // d cos(acos(c) - ts)/dc = cos(ts) - c / sqrt(1 - c^2) * sin(ts)
            const scalar_t dcdev = k.cos_z[z] - t.c / t.sin_c * k.sin_z[z];
            df1[z] = k.zeta[z] * std::pow(base, k.zeta[z] - scalar_t(1)) * dcdev;
          }
          for (int64_t a = 0; a < k.A; ++a) {
            const scalar_t x = t.mean_r - k.shf_a[a];
            f2[a] = std::exp(-k.eta_a[a] * x * x);
            df2[a] = scalar_t(-2) * k.eta_a[a] * x * f2[a];
          }
          const scalar_t* g = grow + k.radial_len +
                              k.pair_index(n1.species, n2.species) * k.A * k.Z;
          scalar_t s_val = 0, s_dc = 0, s_dm = 0;
          for (int64_t a = 0; a < k.A; ++a) {
            scalar_t row_f = 0, row_df = 0;
            for (int64_t z = 0; z < k.Z; ++z) {
              row_f += g[a * k.Z + z] * f1[z];
              row_df += g[a * k.Z + z] * df1[z];
            }
            s_val += row_f * f2[a];
            s_dm += row_f * df2[a];
            s_dc += row_df * f2[a];
          }
          add_triple_grad(n1, n2, t, fc_a[j], fc_a[l], dfc_a[j], dfc_a[l], inv_r[j], inv_r[l],
                          s_val, s_dc, s_dm, grad_edge);
        }
      }
    }
  });
}

}  // namespace

void check_aev_inputs(const char* op, const at::Tensor& species, const at::Tensor& pairs,
                      const at::Tensor& diff_vectors, const AEVParams& p) {
  TORCH_CHECK(species.scalar_type() == at::kLong || species.scalar_type() == at::kInt,
              op, ": species must be int64 or int32, got ", species.scalar_type());
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(0) == 2, op,
              ": pairs must have shape (2, P), got ", pairs.sizes());
  TORCH_CHECK(pairs.scalar_type() == at::kLong || pairs.scalar_type() == at::kInt, op,
              ": pairs must be int64 or int32, got ", pairs.scalar_type());
  TORCH_CHECK(diff_vectors.dim() == 2 && diff_vectors.size(1) == 3 &&
                  diff_vectors.size(0) == pairs.size(1),
              op, ": diff_vectors must have shape (P, 3) with P = ", pairs.size(1),
              " pairs, got ", diff_vectors.sizes());
  TORCH_CHECK(at::isFloatingType(diff_vectors.scalar_type()), op,
              ": diff_vectors must be float32 or float64, got ", diff_vectors.scalar_type());
  TORCH_CHECK(p.num_species > 0, op, ": num_species must be positive, got ", p.num_species);
  TORCH_CHECK(p.angular_cutoff > 0 && p.angular_cutoff <= p.radial_cutoff, op,
              ": need 0 < angular_cutoff <= radial_cutoff, got angular_cutoff=",
              p.angular_cutoff, " radial_cutoff=", p.radial_cutoff);
  const int64_t R = p.radial_shifts.numel(), A = p.angular_shifts.numel(),
                Z = p.angular_sections.numel();
  TORCH_CHECK(R > 0 && A > 0 && Z > 0, op, ": empty AEV shifts or sections");
  TORCH_CHECK(p.radial_eta.numel() == 1 || p.radial_eta.numel() == R, op,
              ": radial_eta must have 1 or ", R, " values, got ", p.radial_eta.numel());
  TORCH_CHECK(p.angular_eta.numel() == 1 || p.angular_eta.numel() == A, op,
              ": angular_eta must have 1 or ", A, " values, got ", p.angular_eta.numel());
  TORCH_CHECK(p.angular_zeta.numel() == 1 || p.angular_zeta.numel() == Z, op,
              ": angular_zeta must have 1 or ", Z, " values, got ", p.angular_zeta.numel());
}


at::Tensor aev_forward_cpu(const at::Tensor& species, const at::Tensor& pairs,
                           const at::Tensor& diff_vectors, const AEVParams& p) {
  const AevInputs in("torchani_fast::aev", species, pairs, diff_vectors, p);
  static thread_local OutputCache cache;
  auto aev = cache.empty(aev_shape(species, p), in.diff.options());  // every row written by the kernel
  AT_DISPATCH_FLOATING_TYPES(in.diff.scalar_type(), "aev_forward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p.radial_cutoff);
    forward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), h, k, in.N,
                   aev.data_ptr<scalar_t>());
  });
  return aev;
}

at::Tensor aev_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const AEVParams& p) {
  const char* op = "torchani_fast::aev_backward";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_grad_aev(op, grad_aev, species, p);
  auto g = in.working(grad_aev);
  auto grad_diff = at::zeros({in.P, 3}, in.diff.options());
  AT_DISPATCH_FLOATING_TYPES(in.diff.scalar_type(), "aev_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p.radial_cutoff);
    std::vector<scalar_t> grad_edge(3 * h.start[in.N], scalar_t(0));
    backward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), h, k, in.N,
                    g.data_ptr<scalar_t>(), grad_edge.data());
    edges_to_pairs(h, grad_edge.data(), in.P, grad_diff.data_ptr<scalar_t>());
  });
  return grad_diff;
}

}  // namespace torchani_fast
