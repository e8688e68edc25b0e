// CPU second derivatives of the AEV: the two halves of aev_backward's backward,
// and the per-atom derivatives from which whole Hessians are assembled.
//
// The math (per pair and per centre atom) is in aev/second_derivs.h, shared
// with the CUDA kernels (aev/cuda/second_cuda.cu); this file builds the CPU
// half-edge layout (aev/half_edges.h), runs the per-centre functions over the
// atoms with at::parallel_for and gathers the results.
//
// Same layout as aev/aev_cpu.cpp: pairs become half edges owned by one atom, each
// atom's AEV row depends only on its own half edges, so the loop over centre
// atoms writes disjoint outputs (no atomics, same bits for any thread count).
// Triples and radial terms whose half edges all have a zero direction
// contribute exactly zero and are skipped: a Hessian column (one coordinate
// moved) then costs the neighbourhood of that atom, not the whole system.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "aev/half_edges.h"
#include "common/parallel.h"
#include "common/simd_math.h"

namespace torchani_fast {

using namespace aev_cpu_detail;

namespace {

// Pair directions (P, 3) -> half-edge directions in each owner's frame.
template <typename scalar_t>
void edge_directions(const HalfEdges& h, const scalar_t* t, int64_t num_pairs,
                     std::vector<scalar_t>& u, std::vector<uint8_t>& moving) {
  const int64_t E = h.edges();
  u.assign(3 * E, scalar_t(0));
  moving.assign(E, 0);
  torchani_fast::parallel_for(0, num_pairs, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      if (h.edge0[q] >= 0)
        aev_math::edge_direction(h.edge0[q], h.edge1[q], t + 3 * q, u.data(), moving.data());
  });
}

#ifdef TF_SIMD_AVX2
// The float32 terms of jvp_center and hvp_center (aev_math::ScalarTerms) with
// their exps and logs 8 at a time (simd::exp, log: within 2 ulp, as the
// vectorised AEV's; the scalar path calls libm): the radial terms of one
// neighbour 8 shifts at a time, the angular terms of a centre's triples 8
// triples at a time, in prepare(), before the centre's loop over its triples
// reads them back by index. Only the transcendentals and the terms they feed
// move here; the geometry and the sums stay in aev_math, so both paths share
// them. The per-centre work does not depend on the thread, so the results are
// the same for any thread count.
using aev_math::ConstView;
using aev_math::Triple;

// float32 scratch of one thread's centres.
struct TermScratch {
  std::vector<Neighbor<float>> neighbors;
  std::vector<Triple<float>> triples;
  std::vector<float> terms;  // angular_scratch_len per triple
  std::vector<float> lanes;  // angular_scratch_len vectors of 8 lanes
};

// o[s] += dr d rad_s / dr (aev_math::radial_jvp).
TF_AVX2 void radial_jvp8(const ConstView<float>& k, float r, float fc, float dfc, float dr,
                         float* o) {
  const __m256 rr = _mm256_set1_ps(r), vfc = _mm256_set1_ps(fc), vdfc = _mm256_set1_ps(dfc);
  const __m256 vdr = _mm256_set1_ps(dr), quarter = _mm256_set1_ps(0.25f);
  int64_t s = 0;
  for (; s + 8 <= k.R; s += 8) {
    const __m256 eta = _mm256_loadu_ps(k.eta_r + s);
    const __m256 x = _mm256_sub_ps(rr, _mm256_loadu_ps(k.shf_r + s));
    const __m256 ex = _mm256_mul_ps(quarter, simd::exp(_mm256_mul_ps(_mm256_mul_ps(
                                                 _mm256_sub_ps(_mm256_setzero_ps(), eta), x), x)));
    const __m256 slope = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_add_ps(eta, eta), x), vfc, vdfc);
    _mm256_storeu_ps(o + s, _mm256_fmadd_ps(_mm256_mul_ps(vdr, ex), slope, _mm256_loadu_ps(o + s)));
  }
  for (; s < k.R; ++s) {
    const float x = r - k.shf_r[s];
    o[s] += dr * (0.25f * std::exp(-k.eta_r[s] * x * x)) * (dfc - 2.0f * k.eta_r[s] * x * fc);
  }
}

// The horizontal sum of v.
TF_AVX2_INLINE float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// aev_math::radial_phi.
TF_AVX2 void radial_phi8(const ConstView<float>& k, float r, const float* g, float& phi1,
                         float& phi2) {
  const float fc = aev_math::cutoff_value(k.cut, r, k.rc_r);
  const float dfc = aev_math::cutoff_deriv(k.cut, r, k.rc_r);
  const float d2fc = aev_math::cutoff_deriv2(k.cut, r, k.rc_r);
  const __m256 rr = _mm256_set1_ps(r), vfc = _mm256_set1_ps(fc), vdfc = _mm256_set1_ps(dfc);
  const __m256 vd2fc = _mm256_set1_ps(d2fc), quarter = _mm256_set1_ps(0.25f);
  __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= k.R; s += 8) {
    const __m256 eta = _mm256_loadu_ps(k.eta_r + s);
    const __m256 x = _mm256_sub_ps(rr, _mm256_loadu_ps(k.shf_r + s));
    const __m256 e = _mm256_mul_ps(quarter, simd::exp(_mm256_mul_ps(_mm256_mul_ps(
                                                _mm256_sub_ps(_mm256_setzero_ps(), eta), x), x)));
    const __m256 two_eta_x = _mm256_mul_ps(_mm256_add_ps(eta, eta), x);
    const __m256 de = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(two_eta_x, e));
    // d2e = (4 eta^2 x^2 - 2 eta) e
    const __m256 d2e = _mm256_mul_ps(
        _mm256_fmsub_ps(two_eta_x, two_eta_x, _mm256_add_ps(eta, eta)), e);
    const __m256 gs = _mm256_loadu_ps(g + s);
    acc1 = _mm256_fmadd_ps(gs, _mm256_fmadd_ps(de, vfc, _mm256_mul_ps(e, vdfc)), acc1);
    const __m256 two_de_dfc = _mm256_mul_ps(_mm256_add_ps(de, de), vdfc);
    acc2 = _mm256_fmadd_ps(
        gs, _mm256_fmadd_ps(d2e, vfc, _mm256_fmadd_ps(e, vd2fc, two_de_dfc)), acc2);
  }
  phi1 = hsum(acc1);
  phi2 = hsum(acc2);
  for (; s < k.R; ++s) {
    const float eta = k.eta_r[s], x = r - k.shf_r[s];
    const float e = 0.25f * std::exp(-eta * x * x), de = -2.0f * eta * x * e;
    const float d2e = (4.0f * eta * eta * x * x - 2.0f * eta) * e;
    phi1 += g[s] * (de * fc + e * dfc);
    phi2 += g[s] * (d2e * fc + 2.0f * de * dfc + e * d2fc);
  }
}

// aev_math::angular_terms of every triple in w.triples into w.terms, 8
// triples per vector (the last vector's extra lanes are computed from benign
// values and dropped). A clamped triple (r1 r2 < 1e-10, where sin_c is 0)
// takes the scalar function, as everywhere else.
TF_AVX2 void angular_terms8(const ConstView<float>& k, bool second, TermScratch& w) {
  const int64_t T = static_cast<int64_t>(w.triples.size()), L = aev_math::angular_scratch_len(k);
  const int64_t Z = k.Z, A = k.A;
  w.terms.resize(T * L);
  w.lanes.resize(8 * L);
  float* lanes = w.lanes.data();
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), two = _mm256_set1_ps(2.0f);
  for (int64_t t0 = 0; t0 < T; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, T - t0);
    alignas(32) float cv[8], sv[8], mv[8];
    for (int64_t j = 0; j < 8; ++j) {
      const bool in = j < n;
      cv[j] = in ? w.triples[t0 + j].c : 0.0f;
      sv[j] = in ? w.triples[t0 + j].sin_c : 1.0f;
      mv[j] = in ? w.triples[t0 + j].mean_r : 0.0f;
    }
    const __m256 c = _mm256_load_ps(cv), s = _mm256_load_ps(sv), m = _mm256_load_ps(mv);
    const __m256 c_over_s = _mm256_div_ps(c, s);
    const __m256 inv_s3 = _mm256_div_ps(one, _mm256_mul_ps(_mm256_mul_ps(s, s), s));
    for (int64_t z = 0; z < Z; ++z) {
      const float zeta = k.zeta[z];
      const __m256 cos_z = _mm256_set1_ps(k.cos_z[z]), sin_z = _mm256_set1_ps(k.sin_z[z]);
      const __m256 cdev = _mm256_fmadd_ps(c, cos_z, _mm256_mul_ps(s, sin_z));
      const __m256 base = _mm256_mul_ps(_mm256_add_ps(one, cdev), half);
      const __m256 ln = simd::log(base);
      const __m256 d1 = _mm256_fnmadd_ps(c_over_s, sin_z, cos_z);
      const bool from_pw2 = second && zeta >= 2.0f;
      const __m256 pw2 = second ? simd::exp(_mm256_mul_ps(_mm256_set1_ps(zeta - 2.0f), ln))
                                : _mm256_setzero_ps();
      const __m256 pw1 = from_pw2 ? _mm256_mul_ps(pw2, base)
                                  : simd::exp(_mm256_mul_ps(_mm256_set1_ps(zeta - 1.0f), ln));
      const __m256 vzeta = _mm256_set1_ps(zeta);
      _mm256_storeu_ps(lanes + 8 * z, _mm256_mul_ps(_mm256_mul_ps(two, pw1), base));
      _mm256_storeu_ps(lanes + 8 * (Z + z), _mm256_mul_ps(_mm256_mul_ps(vzeta, pw1), d1));
      if (second) {
        const __m256 d2 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(sin_z, inv_s3));
        const __m256 curv = _mm256_mul_ps(_mm256_set1_ps(zeta * (zeta - 1.0f) / 2.0f),
                                          _mm256_mul_ps(_mm256_mul_ps(pw2, d1), d1));
        _mm256_storeu_ps(lanes + 8 * (2 * Z + z),
                        _mm256_fmadd_ps(_mm256_mul_ps(vzeta, pw1), d2, curv));
      }
    }
    float* f2 = lanes + 8 * 3 * Z;
    for (int64_t a = 0; a < A; ++a) {
      const __m256 eta = _mm256_set1_ps(k.eta_a[a]);
      const __m256 x = _mm256_sub_ps(m, _mm256_set1_ps(k.shf_a[a]));
      const __m256 e = simd::exp(_mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), eta), x), x));
      const __m256 two_eta_x = _mm256_mul_ps(_mm256_add_ps(eta, eta), x);
      _mm256_storeu_ps(f2 + 8 * a, e);
      _mm256_storeu_ps(f2 + 8 * (A + a), _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(two_eta_x, e)));
      if (second)
        _mm256_storeu_ps(f2 + 8 * (2 * A + a),
                        _mm256_mul_ps(_mm256_fmsub_ps(two_eta_x, two_eta_x, _mm256_add_ps(eta, eta)), e));
    }
    for (int64_t j = 0; j < n; ++j) {
      float* o = w.terms.data() + (t0 + j) * L;
      const Triple<float>& t = w.triples[t0 + j];
      if (t.clamped) {
        aev_math::angular_terms(k, t, second, o);
        continue;
      }
      for (int64_t q = 0; q < L; ++q) o[q] = lanes[8 * q + j];
    }
  }
}

// The aev_math Terms policy of the float32 AVX2 path.
struct VectorTerms {
  TermScratch* w;

  template <typename Edges>
  void prepare(const ConstView<float>& k, const Edges& h, int64_t i, const uint8_t* moving,
               bool second) const {
    const int64_t begin = h.begin(i), n = h.end(i) - begin;
    w->neighbors.resize(n);
    for (int64_t e = 0; e < n; ++e) w->neighbors[e] = h.neighbor(begin + e);
    w->triples.clear();
    for (int64_t e1 = 0; e1 < n; ++e1)
      for (int64_t e2 = e1 + 1; e2 < n; ++e2)
        if (aev_math::visits_triple(k, w->neighbors[e1].r, w->neighbors[e2].r, moving,
                                    begin + e1, begin + e2))
          w->triples.push_back(make_triple(w->neighbors[e1], w->neighbors[e2]));
    angular_terms8(k, second, *w);
  }
  void radial_jvp(const ConstView<float>& k, float r, float fc, float dfc, float dr,
                  float* o) const {
    radial_jvp8(k, r, fc, dfc, dr, o);
  }
  void radial_phi(const ConstView<float>& k, float r, const float* g, float& phi1,
                  float& phi2) const {
    radial_phi8(k, r, g, phi1, phi2);
  }
  const float* angular(const ConstView<float>& k, const Triple<float>&, int64_t index, bool,
                       float*) const {
    return w->terms.data() + index * aev_math::angular_scratch_len(k);
  }
};
#endif

// fn(i, terms, w) for each centre i in [0, N) in parallel, with the fastest
// Terms policy for scalar_t and w: angular_scratch_len scalars of the thread.
template <typename scalar_t, typename Fn>
void for_each_centre(int64_t N, const aev_math::ConstView<scalar_t>& k, const Fn& fn) {
  torchani_fast::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
    std::vector<scalar_t> w(aev_math::angular_scratch_len(k));
#ifdef TF_SIMD_AVX2
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (simd::have_avx2()) {
        TermScratch scratch;
        for (int64_t i = begin; i < end; ++i) fn(i, VectorTerms{&scratch}, w.data());
        return;
      }
    }
#endif
    for (int64_t i = begin; i < end; ++i) fn(i, aev_math::ScalarTerms<scalar_t>{}, w.data());
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
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_tangent(op, tangent, diff_vectors);
  auto t = in.working(tangent);
  const int64_t N = in.N, P = in.P;
  const at::Tensor& sp = in.species;
  const at::Tensor& diff = in.diff;
  // Each row is zeroed by the thread that fills it, just before (jvp_center
  // adds to it): no separate pass over the whole (N, F) output first.
  auto out = at::empty(aev_shape(species, p), diff.options());
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_jvp_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p);
    std::vector<scalar_t> u;
    std::vector<uint8_t> moving;
    edge_directions(h, t.data_ptr<scalar_t>(), P, u, moving);
    const auto kv = k.view();
    const HalfEdgeView<scalar_t> hv(h, sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>());
    const int64_t* spp = sp.data_ptr<int64_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    std::vector<scalar_t> fcw(u.size());
    for_each_centre(N, kv, [&](int64_t i, auto terms, scalar_t* w) {
      scalar_t* row = o + i * kv.F;
      std::fill(row, row + kv.F, scalar_t(0));
      if (spp[i] >= 0)
        aev_math::jvp_center(kv, hv, i, u.data(), moving.data(), w, fcw.data(), row, terms);
    });
  });
  return out;
}

at::Tensor aev_double_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                   const at::Tensor& species, const at::Tensor& pairs,
                                   const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_double_backward";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_tangent(op, tangent, diff_vectors);
  check_grad_aev(op, grad_aev, species, p);
  auto g = in.working(grad_aev);
  auto t = in.working(tangent);
  const int64_t N = in.N, P = in.P;
  const at::Tensor& sp = in.species;
  const at::Tensor& diff = in.diff;
  auto out = at::empty({P, 3}, diff.options());  // every row written by edges_to_pairs
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_double_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p);
    std::vector<scalar_t> u;
    std::vector<uint8_t> moving;
    edge_directions(h, t.data_ptr<scalar_t>(), P, u, moving);
    std::vector<scalar_t> out_edge(u.size(), scalar_t(0)), fcw(u.size());
    const auto kv = k.view();
    const HalfEdgeView<scalar_t> hv(h, sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>());
    const int64_t* spp = sp.data_ptr<int64_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    for_each_centre(N, kv, [&](int64_t i, auto terms, scalar_t* w) {
      if (spp[i] >= 0)
        aev_math::hvp_center(kv, hv, i, gp + i * kv.F, u.data(), moving.data(), w, fcw.data(),
                             out_edge.data(), terms);
    });
    edges_to_pairs(h, out_edge.data(), P, out.data_ptr<scalar_t>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cpu(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_local_derivatives";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_grad_aev(op, grad_aev, species, p);
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
  auto g = in.working(grad_aev);
  const int64_t N = in.N;
  const at::Tensor& sp = in.species;
  const at::Tensor& diff = in.diff;
  at::Tensor local_atoms, jac, curv;
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_local_derivatives_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p);
    const auto kv = k.view();
    const HalfEdgeView<scalar_t> hv(h, sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>());
    const int64_t* spp = sp.data_ptr<int64_t>();
    const int64_t E = h.edges();
    // Slots of each centre's neighbours (see local_slots_center), then K = the most.
    std::vector<int64_t> slot(E), first_pair(E), count(N, 1);
    torchani_fast::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (spp[i] >= 0) count[i] = aev_math::local_slots_center(hv, i, first_pair.data(),
                                                                 slot.data());
    });
    int64_t K = 1;
    for (int64_t i = 0; i < N; ++i) K = std::max(K, count[i]);
    local_atoms = at::full({N, K}, -1, at::TensorOptions().dtype(at::kLong));
    int64_t* la = local_atoms.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
      if (spp[i] < 0) continue;
      la[i * K] = i;
      for (int64_t e = h.start[i]; e < h.start[i + 1]; ++e) la[i * K + slot[e]] = h.other[e];
    }
    jac = at::zeros({N, K, 3, C}, diff.options());
    curv = at::zeros({N, K, 3, K, 3}, diff.options());
    scalar_t* jp = jac.data_ptr<scalar_t>();
    scalar_t* cp = curv.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    std::vector<scalar_t> fcw(3 * E);
    torchani_fast::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
      const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
      std::vector<scalar_t> w(aev_math::angular_scratch_len(kv));
      for (int64_t i = begin; i < end; ++i)
        if (spp[i] >= 0)
          aev_math::local_center(kv, hv, i, gp + i * kv.F, slot.data(), colmap.data(), C, K,
                                 w.data(), fcw.data(), jp + i * 3 * K * C,
                                 cp + i * 9 * K * K);
    });
  });
  return {local_atoms, jac, curv};
}

}  // namespace torchani_fast
