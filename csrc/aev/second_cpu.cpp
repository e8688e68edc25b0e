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
#include "common/simd_math_f64.h"

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
// jvp_center and hvp_center on lanes (aev/second_lanes.h): float32 on 8 lanes
// (AVX2), float64 on 4 (AVX2) or 8 (AVX-512).
using aev_math::ConstView;
using aev_math::Triple;

// (GCC 12's AVX-512 headers read `_mm512_undefined_*()` in some unmasked
// operations; the values are never used.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "aev/vector_f64_lanes.h"  // x4, x8: the float64 lane operations

// float32 on 8 lanes: vector_f64_lanes.h's operations that second_lanes.h
// uses, for floats.
namespace f32x8 {
using vd = __m256;
using S = float;
constexpr int64_t kLanes = 8;
TF_AVX2_INLINE vd ld(const float* p) { return _mm256_loadu_ps(p); }
TF_AVX2_INLINE void st(float* p, vd x) { _mm256_storeu_ps(p, x); }
TF_AVX2_INLINE vd bc(float x) { return _mm256_set1_ps(x); }
TF_AVX2_INLINE vd add(vd a, vd b) { return _mm256_add_ps(a, b); }
TF_AVX2_INLINE vd sub(vd a, vd b) { return _mm256_sub_ps(a, b); }
TF_AVX2_INLINE vd mul(vd a, vd b) { return _mm256_mul_ps(a, b); }
TF_AVX2_INLINE vd div(vd a, vd b) { return _mm256_div_ps(a, b); }
TF_AVX2_INLINE vd fma(vd a, vd b, vd c) { return _mm256_fmadd_ps(a, b, c); }    // a b + c
TF_AVX2_INLINE vd fnma(vd a, vd b, vd c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
TF_AVX2_INLINE vd fms(vd a, vd b, vd c) { return _mm256_fmsub_ps(a, b, c); }    // a b - c
TF_AVX2_INLINE vd zero() { return _mm256_setzero_ps(); }
TF_AVX2_INLINE float hsum(vd v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
TF_AVX2_INLINE vd gather(const float* base, const int32_t* offsets, int32_t extra) {
  const __m256i at = _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets)),
                                      _mm256_set1_epi32(extra));
  return _mm256_i32gather_ps(base, at, 4);
}
}  // namespace f32x8

// Each width's kernels, in the namespace of its operations, with its targets.
#define TF_LANE_FN TF_AVX2
#define TF_LANE_INLINE TF_AVX2_INLINE
namespace f32x8 {
#include "aev/second_lanes.h"
}  // namespace f32x8
namespace x4 {
#include "aev/second_lanes.h"
}  // namespace x4
#undef TF_LANE_FN
#undef TF_LANE_INLINE
#define TF_LANE_FN TF_AVX512
#define TF_LANE_INLINE TF_AVX512_INLINE
namespace x8 {
#include "aev/second_lanes.h"
}  // namespace x8
#undef TF_LANE_FN
#undef TF_LANE_INLINE
#pragma GCC diagnostic pop

// Runs fn(terms) with the vectorised Terms policy of scalar_t on this CPU,
// and returns true; false where there is none (no AVX2, or more angular
// shifts or sections than the lane kernels hold).
template <typename scalar_t, typename Fn>
bool with_vector_terms(const ConstView<scalar_t>& k, const Fn& fn) {
  if (!simd::have_avx2() || k.A > f32x8::kMaxAngular || k.Z > f32x8::kMaxAngular) return false;
  if constexpr (std::is_same_v<scalar_t, float>) {
    f32x8::TermScratch scratch;
    fn(f32x8::VectorTerms{&scratch});
  } else if (simd::have_avx512()) {
    x8::TermScratch scratch;
    fn(x8::VectorTerms{&scratch});
  } else {
    x4::TermScratch scratch;
    fn(x4::VectorTerms{&scratch});
  }
  return true;
}
#endif

// fn(i, terms, w) for each centre i in [0, N) in parallel, with the fastest
// Terms policy for scalar_t and w: angular_scratch_len scalars of the thread.
template <typename scalar_t, typename Fn>
void for_each_centre(int64_t N, const aev_math::ConstView<scalar_t>& k, const Fn& fn) {
  torchani_fast::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
    std::vector<scalar_t> w(aev_math::angular_scratch_len(k));
    auto run = [&](const auto& terms) {
      for (int64_t i = begin; i < end; ++i) fn(i, terms, w.data());
    };
#ifdef TF_SIMD_AVX2
    if (with_vector_terms(k, run)) return;
#endif
    run(aev_math::ScalarTerms<scalar_t>{});
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
    for_each_centre(N, kv, [&](int64_t i, const auto& terms, scalar_t* w) {
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
    for_each_centre(N, kv, [&](int64_t i, const auto& terms, scalar_t* w) {
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
