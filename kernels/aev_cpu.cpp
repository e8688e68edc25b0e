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
#include <cstdint>
#include <memory>
#include <mutex>
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
// (GCC 12's AVX-512 headers read `_mm256_undefined_*()` in the casts and
// extracts of the 16-lane code; the values are never used.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// float32 on AVX2 CPUs when R is a multiple of 8, A <= 8 and Z is 1, 2, 4 or 8
// (every ANI model: ANI-1x A = 4, Z = 8; ANI-2x A = 8, Z = 4). Radial terms:
// 8 shifts per vector. Angular terms: 8 triples per vector. An atom's
// neighbours come sorted by species (stably: build_half_edges), so that the
// triples of one species pair, which all add to the same AEV block, can be
// listed together; each block's list is padded to whole vectors with triples
// that add zero.
// The forward then keeps one accumulator vector per term of the block, and the
// backward reads the block's gradient as broadcasts. Per atom, the work and its
// order are fixed by the input, so results do not depend on the thread count.
// With AVX-512 the exp and log run on 16 lanes (two vectors of 8 triples or
// neighbours; blocks padded to 16), each lane doing the 8-lane code's
// operations, and the forward's sums stay on 8 lanes in the same order: the
// same bits as AVX2 (*512 functions, chosen per call with simd::have_avx512()).
// There the exp and log of several shifts or sections run side by side
// (simd::exp_n, log_n): as independent chains, one after the other, they
// kept the core waiting on their latency (10-15% of the AEV's time).
bool vector_path(const Consts<float>& k) {
  return simd::have_avx2() && k.R % 8 == 0 && k.A <= 8 &&
         (k.Z == 1 || k.Z == 2 || k.Z == 4 || k.Z == 8);
}

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
  TF_AVX2 void cutoffs(float rc, bool backward) {
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
  all.cutoffs(k.rc_r, backward);
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
  ang.cutoffs(k.rc_a, backward);
}

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
  all.cutoffs(k.rc_r, backward);
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
  ang.cutoffs(k.rc_a, backward);
}

// sorted_neighbors, on 16 lanes where `wide`.
TF_AVX2_INLINE void sorted_neighbors_any(const HalfEdges& h, int64_t i, const Consts<float>& k,
                                         bool backward, CentreScratch& w, bool wide) {
  if (wide) return sorted_neighbors512(h, i, k, backward, w);
  sorted_neighbors(h, i, k, backward, w);
}

TF_AVX2_INLINE void store_at(std::vector<float>& v, int64_t t, __m256 x) {
  _mm256_storeu_ps(v.data() + t, x);
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

constexpr int kMaxShifts = 8;  // (A <= 8: vector_path)

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

// The 8 horizontal sums of v[0..8), in order.
TF_AVX2_INLINE __m256 sums8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

TF_AVX512_INLINE __m512 load16(const std::vector<float>& v, int64_t t) {
  return _mm512_loadu_ps(v.data() + t);
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
#pragma GCC diagnostic pop
#endif

// Whether the vectorised kernels compute this AEV (their half edges carry
// vectors: build_half_edges).
template <typename scalar_t>
bool vector_kernels(const Consts<scalar_t>& k) {
#ifdef TF_SIMD_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) return vector_path(k);
#endif
  return false;
}

template <typename scalar_t>
void forward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                    const Consts<scalar_t>& k, int64_t num_atoms, scalar_t* aev) {
#ifdef TF_SIMD_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (h.vectors) {
      const bool wide = simd::have_avx512();
      at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
        const simd::FlushDenormals flush;
        forward_atoms_avx2(begin, end, species, h, k, aev, wide);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
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

// The half-edge gradients of atoms [begin, end), zeroed by the thread that
// then adds to them (each atom writes only its own half edges).
template <typename scalar_t>
void zero_edges(const HalfEdges& h, int64_t begin, int64_t end, scalar_t* grad_edge) {
  std::fill(grad_edge + 3 * h.start[begin], grad_edge + 3 * h.start[end], scalar_t(0));
}

template <typename scalar_t>
void backward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                     const Consts<scalar_t>& k, int64_t num_atoms, const scalar_t* grad_aev,
                     scalar_t* grad_edge) {
#ifdef TF_SIMD_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (h.vectors) {
      const bool wide = simd::have_avx512();
      at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
        const simd::FlushDenormals flush;
        zero_edges(h, begin, end, grad_edge);
        backward_atoms_avx2(begin, end, species, h, k, grad_aev, grad_edge, wide);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
    zero_edges(h, begin, end, grad_edge);
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

// The forward's half edges, kept for the backward of the same inputs, which
// then does not build them again (for 3 000 waters that build was 0.5-0.8 ms
// of a 32 ms energy + forces call at 2 threads). One entry, kept only when
// the vectors require grad and the half edges take at most kMaxBytes (about
// 50 000 atoms of water: a box of 98 304 would hold 120 MB through the
// networks, 9% more peak memory), and taken (freed) by the backward. The
// inputs match when they are the same tensors at the same version, data
// pointer, sizes and strides, with the same cutoff and species count. A
// tensor is referenced weakly, which keeps its TensorImpl's address from
// being reused (as PyTorch's profiler tracks tensors), so a new tensor cannot
// match a freed one. Autograd's own saved-tensor check relies on the same
// version counters.
class EdgeCache {
 public:
  void put(const at::Tensor& species, const at::Tensor& pairs, const at::Tensor& diff,
           const AEVParams& p, std::shared_ptr<const HalfEdges> h) {
    std::lock_guard<std::mutex> lock(mutex_);
    ids_.clear();
    edges_.reset();
    if (species.is_inference() || pairs.is_inference() || diff.is_inference() ||
        h->bytes() > kMaxBytes)
      return;
    ids_ = {Id(species), Id(pairs), Id(diff)};
    cutoff_ = p.radial_cutoff;
    num_species_ = p.num_species;
    edges_ = std::move(h);
  }

  // The half edges of these inputs, in the layout `vectors`, if they are cached
  // (and then no longer), else null.
  std::shared_ptr<const HalfEdges> take(const at::Tensor& species, const at::Tensor& pairs,
                                        const at::Tensor& diff, const AEVParams& p,
                                        bool vectors) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!edges_ || !ids_[0].same(species) || !ids_[1].same(pairs) || !ids_[2].same(diff) ||
        cutoff_ != p.radial_cutoff || num_species_ != p.num_species ||
        edges_->vectors != vectors)
      return nullptr;
    ids_.clear();
    return std::move(edges_);
  }

 private:
  struct Id {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    int64_t version;
    const void* data;
    std::vector<int64_t> sizes, strides;

    explicit Id(const at::Tensor& t)
        : impl(t.getIntrusivePtr()), version(t._version()), data(t.data_ptr()),
          sizes(t.sizes().vec()), strides(t.strides().vec()) {}
    bool same(const at::Tensor& t) const {
      return impl._unsafe_get_target() == t.unsafeGetTensorImpl() && !t.is_inference() &&
             t._version() == version && t.data_ptr() == data && t.sizes().equals(sizes) &&
             t.strides().equals(strides);
    }
  };
  static constexpr size_t kMaxBytes = size_t(64) << 20;
  std::mutex mutex_;
  std::vector<Id> ids_;  // species, pairs, diff; empty when nothing is cached
  double cutoff_ = 0;
  int64_t num_species_ = 0;
  std::shared_ptr<const HalfEdges> edges_;
};

EdgeCache& edge_cache() {
  static EdgeCache cache;
  return cache;
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
    auto h = std::make_shared<const HalfEdges>(in.half_edges<scalar_t>(p, vector_kernels(k)));
    forward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), *h, k, in.N,
                   aev.data_ptr<scalar_t>());
    if (diff_vectors.requires_grad())
      edge_cache().put(species, pairs, diff_vectors, p, std::move(h));
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
  auto grad_diff = at::empty({in.P, 3}, in.diff.options());  // every row written by edges_to_pairs
  AT_DISPATCH_FLOATING_TYPES(in.diff.scalar_type(), "aev_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    const auto cached = edge_cache().take(species, pairs, diff_vectors, p, vector_kernels(k));
    HalfEdges built;
    if (!cached) built = in.half_edges<scalar_t>(p, vector_kernels(k));
    const HalfEdges& h = cached ? *cached : built;
    UninitVector<scalar_t> grad_edge(3 * h.start[in.N]);  // zeroed by backward_kernel
    backward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), h, k, in.N,
                    g.data_ptr<scalar_t>(), grad_edge.data());
    edges_to_pairs(h, grad_edge.data(), in.P, grad_diff.data_ptr<scalar_t>());
  });
  return grad_diff;
}

}  // namespace torchani_fast
