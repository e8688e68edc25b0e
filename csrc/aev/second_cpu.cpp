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
    torchani_fast::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
      const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
      std::vector<scalar_t> w(aev_math::angular_scratch_len(kv));
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* row = o + i * kv.F;
        std::fill(row, row + kv.F, scalar_t(0));
        if (spp[i] >= 0)
          aev_math::jvp_center(kv, hv, i, u.data(), moving.data(), w.data(), fcw.data(), row);
      }
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
    torchani_fast::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
      const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
      std::vector<scalar_t> w(aev_math::angular_scratch_len(kv));
      for (int64_t i = begin; i < end; ++i)
        if (spp[i] >= 0)
          aev_math::hvp_center(kv, hv, i, gp + i * kv.F, u.data(), moving.data(), w.data(),
                               fcw.data(), out_edge.data());
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
