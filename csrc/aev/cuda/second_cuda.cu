// CUDA second derivatives of the AEV: aev_jvp, aev_double_backward and
// aev_local_derivatives (Hessians, force training).
//
// The math is aev/second_derivs.h, the same functions the CPU kernels call
// (aev/second_cpu.cpp); here one thread runs them for one centre
// atom, over the sorted half edges of aev/cuda/edges.cuh (the layout of the
// forward and backward kernels). Every thread writes only its own atom's AEV
// row, its own half edges and its own slots, so nothing is accumulated by
// atomics and a given input gives the same bits on every run. The CPU walks
// each atom's neighbours in pair order, the GPU in its sorted order, so the
// two agree to rounding (not bitwise).
//
//   directions_kernel  thread per pair: tangent -> per-half-edge directions
//   jvp_kernel         thread per atom: row i of J t
//   hvp_kernel         thread per atom: (sum_f g_f Hess aev_f) t per half edge
//   hvp_gather_kernel  thread per pair: back from half edges to pairs
//   slots_kernel       thread per atom: slots of the atoms its AEV depends on
//   local_kernel       thread per atom: local_atoms row, Jacobian, curvature
//
// Synchronisation: aev_jvp and aev_double_backward read nothing back. Their
// value errors are encoded as in aev/aev_backward: aev_jvp gives NaN rows for
// species outside [-1, num_species) and a NaN output for pair indices >= M*A;
// aev_double_backward skips both (zero contributions), like aev_backward.
// aev_local_derivatives must read its slot count K back (output shapes depend
// on it): that one synchronisation also carries its value checks, so it
// raises with the CPU's messages.
#include "aev/cuda/edges.cuh"
#include "aev/second_derivs.h"
#include "common/cuda_common.cuh"
#include "ops.h"

namespace torchani_fast {
namespace {

constexpr int kSecondThreads = 128;

// The sorted half edges of aev/cuda/edges.cuh as an edge view of
// aev/second_derivs.h. pair_ and other_ are only filled for the local derivatives.
template <typename scalar_t>
struct DeviceEdgeView {
  const int64_t* start_;
  const scalar_t* data_;
  const int32_t* nspec_;
  const int64_t* pair_;
  const int64_t* other_;

  TF_HOST_DEVICE int64_t begin(int64_t i) const { return start_[i]; }
  TF_HOST_DEVICE int64_t end(int64_t i) const { return start_[i + 1]; }
  TF_HOST_DEVICE int64_t other(int64_t e) const { return other_[e]; }
  TF_HOST_DEVICE int64_t pair(int64_t e) const { return pair_[e]; }
  TF_HOST_DEVICE aev_math::Neighbor<scalar_t> neighbor(int64_t e) const {
    const scalar_t* d = data_ + kEdgeFields * e;
    aev_math::Neighbor<scalar_t> n;
    n.v[0] = d[kVx];
    n.v[1] = d[kVy];
    n.v[2] = d[kVz];
    n.r = d[kR];
    n.species = nspec_[e];
    n.edge = e;
    return n;
  }
};

// The constants expanded to full length in the working dtype, in one device
// buffer (built with ATen ops on the stream: no host copy of the parameters).
template <typename scalar_t>
struct DeviceConsts {
  at::Tensor buffer;
  aev_math::ConstView<scalar_t> view;

  DeviceConsts(const AEVParams& a, const Params<scalar_t>& k, at::ScalarType dtype) {
    auto full = [&](const at::Tensor& t, int64_t n) {
      auto c = t.detach().to(dtype).reshape({-1});
      return c.numel() == 1 ? c.expand({n}) : c;
    };
    auto sections = a.angular_sections.detach().to(dtype).reshape({-1});
    buffer = at::cat({full(a.radial_eta, k.R), full(a.radial_shifts, k.R),
                      full(a.angular_eta, k.A), full(a.angular_shifts, k.A),
                      full(a.angular_zeta, k.Z), at::cos(sections), at::sin(sections)})
                 .contiguous();
    const scalar_t* b = buffer.data_ptr<scalar_t>();
    view.S = k.S;
    view.R = k.R;
    view.A = k.A;
    view.Z = k.Z;
    view.F = k.F;
    view.radial_len = k.radial_len;
    view.rc_r = k.rc_r;
    view.rc_a = k.rc_a;
    view.cut = k.cut;
    view.eta_r = b;
    view.shf_r = b + k.R;
    view.eta_a = b + 2 * k.R;
    view.shf_a = view.eta_a + k.A;
    view.zeta = view.shf_a + k.A;
    view.cos_z = view.zeta + k.Z;
    view.sin_z = view.cos_z + k.Z;
  }
};

template <typename scalar_t>
DeviceEdgeView<scalar_t> edge_view(const Edges& h, const int64_t* pair = nullptr,
                                   const int64_t* other = nullptr) {
  return {h.start.data_ptr<int64_t>(), h.data.data_ptr<scalar_t>(), h.nspec.data_ptr<int32_t>(),
          pair, other};
}

#define TF_GRID_STRIDE(i, n)                                                      \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

template <typename scalar_t>
__global__ void directions_kernel(int64_t P, const uint8_t* __restrict__ keep,
                                  const int64_t* __restrict__ pair_edge,
                                  const scalar_t* __restrict__ tangent, scalar_t* __restrict__ u,
                                  uint8_t* __restrict__ moving) {
  TF_GRID_STRIDE(p, P) {
    if (keep[p] != 0)
      aev_math::edge_direction(pair_edge[2 * p], pair_edge[2 * p + 1], tangent + 3 * p, u,
                               moving);
  }
}

template <typename scalar_t>
__global__ void jvp_kernel(aev_math::ConstView<scalar_t> k, DeviceEdgeView<scalar_t> h,
                           int64_t N, const int64_t* __restrict__ species,
                           const int64_t* __restrict__ err, const scalar_t* __restrict__ u,
                           const uint8_t* __restrict__ moving, scalar_t* __restrict__ w,
                           scalar_t* __restrict__ fcw, scalar_t* __restrict__ out) {
  const bool failed = err[0] != 0;
  const int64_t wl = aev_math::angular_scratch_len(k);
  TF_GRID_STRIDE(i, N) {
    const int64_t s = species[i];
    scalar_t* row = out + i * k.F;
    if (failed || s < -1 || s >= k.S) {
      for (int64_t f = 0; f < k.F; ++f) row[f] = scalar_t(NAN);
    } else if (s >= 0) {
      aev_math::jvp_center(k, h, i, u, moving, w + i * wl, fcw, row);
    }
  }
}

template <typename scalar_t>
__global__ void hvp_kernel(aev_math::ConstView<scalar_t> k, DeviceEdgeView<scalar_t> h,
                           int64_t N, const int64_t* __restrict__ species,
                           const int64_t* __restrict__ err, const scalar_t* __restrict__ grad_aev,
                           const scalar_t* __restrict__ u, const uint8_t* __restrict__ moving,
                           scalar_t* __restrict__ w, scalar_t* __restrict__ fcw,
                           scalar_t* __restrict__ out_edge) {
  if (err[0] != 0) return;
  const int64_t wl = aev_math::angular_scratch_len(k);
  TF_GRID_STRIDE(i, N) {
    const int64_t s = species[i];
    if (s >= 0 && s < k.S)
      aev_math::hvp_center(k, h, i, grad_aev + i * k.F, u, moving, w + i * wl, fcw, out_edge);
  }
}

template <typename scalar_t>
__global__ void hvp_gather_kernel(int64_t P, const uint8_t* __restrict__ keep,
                                  const int64_t* __restrict__ pair_edge,
                                  const scalar_t* __restrict__ out_edge,
                                  scalar_t* __restrict__ out) {
  TF_GRID_STRIDE(p, P) {
    scalar_t o[3] = {0, 0, 0};
    if (keep[p] != 0) {  // pair_edge is only written for kept pairs
      const int64_t e0 = pair_edge[2 * p], e1 = pair_edge[2 * p + 1];
      for (int c = 0; c < 3; ++c) o[c] = out_edge[3 * e1 + c] - out_edge[3 * e0 + c];
    }
    for (int c = 0; c < 3; ++c) out[3 * p + c] = o[c];
  }
}

// Pair index and neighbour atom of every sorted half edge (for the slots).
__global__ void edge_ids_kernel(int64_t P, const int64_t* __restrict__ pairs,
                                const uint8_t* __restrict__ keep,
                                const int64_t* __restrict__ pair_edge,
                                int64_t* __restrict__ edge_pair, int64_t* __restrict__ edge_other) {
  TF_GRID_STRIDE(p, P) {
    if (keep[p] == 0) continue;
    const int64_t e0 = pair_edge[2 * p], e1 = pair_edge[2 * p + 1];
    edge_pair[e0] = p;
    edge_pair[e1] = p;
    edge_other[e0] = pairs[P + p];
    edge_other[e1] = pairs[p];
  }
}

template <typename scalar_t>
__global__ void slots_kernel(DeviceEdgeView<scalar_t> h, int64_t N, int64_t S,
                             const int64_t* __restrict__ species, int64_t* __restrict__ first_pair,
                             int64_t* __restrict__ slot, int64_t* __restrict__ count) {
  TF_GRID_STRIDE(i, N) {
    const int64_t s = species[i];
    count[i] = s >= 0 && s < S ? aev_math::local_slots_center(h, i, first_pair, slot) : 1;
  }
}

__global__ void colmap_kernel(int64_t C, int64_t F, const int64_t* __restrict__ columns,
                              int64_t* __restrict__ colmap) {
  TF_GRID_STRIDE(c, C) {
    const int64_t f = columns[c];
    if (f >= 0 && f < F) colmap[f] = c;
  }
}

template <typename scalar_t>
__global__ void local_kernel(aev_math::ConstView<scalar_t> k, DeviceEdgeView<scalar_t> h,
                             int64_t N, int64_t K, int64_t C, const int64_t* __restrict__ species,
                             const scalar_t* __restrict__ grad_aev,
                             const int64_t* __restrict__ slot, const int64_t* __restrict__ colmap,
                             scalar_t* __restrict__ w, scalar_t* __restrict__ fcw,
                             int64_t* __restrict__ local_atoms, scalar_t* __restrict__ jac,
                             scalar_t* __restrict__ curv) {
  const int64_t wl = aev_math::angular_scratch_len(k);
  TF_GRID_STRIDE(i, N) {
    if (species[i] < 0) continue;  // checked to be < S before the launch
    int64_t* la = local_atoms + i * K;
    la[0] = i;
    for (int64_t e = h.begin(i); e < h.end(i); ++e) la[slot[e]] = h.other(e);
    aev_math::local_center(k, h, i, grad_aev + i * k.F, slot, colmap, C, K, w + i * wl, fcw,
                           jac + i * 3 * K * C, curv + i * 9 * K * K);
  }
}

void check_second_inputs(const char* op, const at::Tensor& species, const at::Tensor& pairs,
                         const at::Tensor& diff, const AEVParams& p, const at::Tensor* grad_aev,
                         const at::Tensor* tangent) {
  check_aev_inputs(op, species, pairs, diff, p);
  check_devices(op, species, pairs, diff, p);
  if (grad_aev) {
    cuda::check_same_device(op, "grad_aev", *grad_aev, diff.device());
    TORCH_CHECK(grad_aev->numel() == species.numel() * aev_length(p), op,
                ": grad_aev must have shape species.shape + (", aev_length(p), ",), got ",
                grad_aev->sizes());
  }
  if (tangent) {
    cuda::check_same_device(op, "tangent", *tangent, diff.device());
    TORCH_CHECK(tangent->sizes() == diff.sizes(), op,
                ": tangent must have the shape of diff_vectors ", diff.sizes(), ", got ",
                tangent->sizes());
    TORCH_CHECK(at::isFloatingType(tangent->scalar_type()), op,
                ": tangent must be floating point, got ", tangent->scalar_type());
  }
}

// Per-half-edge directions u (E, 3) and moving flags (E,) of a pair tangent.
template <typename scalar_t>
std::pair<at::Tensor, at::Tensor> edge_directions(const Edges& h, const at::Tensor& t) {
  auto u = at::zeros({h.E, 3}, t.options());
  auto moving = at::zeros({h.E}, t.options().dtype(at::kByte));
  if (h.P > 0) {
    directions_kernel<scalar_t><<<cuda::grid_for(h.P, kThreads), kThreads, 0,
                                  at::cuda::getCurrentCUDAStream()>>>(
        h.P, h.keep.data_ptr<uint8_t>(), h.pair_edge.data_ptr<int64_t>(),
        t.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), moving.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {u, moving};
}

// Index of the first true entry of a 1-D bool tensor (its length if none), on the device.
at::Tensor first_true(const at::Tensor& mask) {
  return at::cat({mask, at::ones({1}, mask.options())}).to(at::kLong).argmax();
}

// The value at a first_true index (0 when there is none), on the device.
at::Tensor value_at(const at::Tensor& values, const at::Tensor& index) {
  return at::cat({values, at::zeros({1}, values.options())}).index({index});
}

}  // namespace

at::Tensor aev_jvp_cuda(const at::Tensor& tangent, const at::Tensor& species,
                        const at::Tensor& pairs, const at::Tensor& diff_vectors,
                        const AEVParams& p) {
  const char* op = "torchani_fast::aev_jvp";
  check_second_inputs(op, species, pairs, diff_vectors, p, nullptr, &tangent);
  c10::cuda::CUDAGuard guard(diff_vectors.device());
  auto sp = species.to(at::kLong).contiguous();
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto t = tangent.to(diff.scalar_type()).contiguous();
  std::vector<int64_t> out_shape(species.sizes().begin(), species.sizes().end());
  out_shape.push_back(aev_length(p));
  auto out = at::zeros(out_shape, diff.options());
  const int64_t N = sp.numel();
  if (N == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_jvp_cuda", [&] {
    ParamTensors<scalar_t> pt(p, diff.scalar_type());
    DeviceConsts<scalar_t> dc(p, pt.p, diff.scalar_type());
    Edges h = build_edges(pt.p, sp, pr, diff);
    auto dirs = edge_directions<scalar_t>(h, t);
    auto w = at::empty({N, aev_math::angular_scratch_len(dc.view)}, diff.options());
    auto fcw = at::empty({h.E, 3}, diff.options());
    jvp_kernel<scalar_t><<<cuda::grid_for(N, kSecondThreads), kSecondThreads, 0,
                           at::cuda::getCurrentCUDAStream()>>>(
        dc.view, edge_view<scalar_t>(h), N, sp.data_ptr<int64_t>(), h.err.data_ptr<int64_t>(),
        dirs.first.data_ptr<scalar_t>(), dirs.second.data_ptr<uint8_t>(),
        w.data_ptr<scalar_t>(), fcw.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor aev_double_backward_cuda(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                    const at::Tensor& species, const at::Tensor& pairs,
                                    const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_double_backward";
  check_second_inputs(op, species, pairs, diff_vectors, p, &grad_aev, &tangent);
  c10::cuda::CUDAGuard guard(diff_vectors.device());
  auto sp = species.to(at::kLong).contiguous();
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto g = grad_aev.to(diff.scalar_type()).contiguous();
  auto t = tangent.to(diff.scalar_type()).contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  auto out = at::empty({P, 3}, diff.options());
  if (P == 0) return out;
  if (N == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_double_backward_cuda", [&] {
    ParamTensors<scalar_t> pt(p, diff.scalar_type());
    DeviceConsts<scalar_t> dc(p, pt.p, diff.scalar_type());
    Edges h = build_edges(pt.p, sp, pr, diff);
    auto dirs = edge_directions<scalar_t>(h, t);
    auto w = at::empty({N, aev_math::angular_scratch_len(dc.view)}, diff.options());
    auto fcw = at::empty({h.E, 3}, diff.options());
    auto out_edge = at::zeros({h.E, 3}, diff.options());
    auto stream = at::cuda::getCurrentCUDAStream();
    hvp_kernel<scalar_t><<<cuda::grid_for(N, kSecondThreads), kSecondThreads, 0, stream>>>(
        dc.view, edge_view<scalar_t>(h), N, sp.data_ptr<int64_t>(), h.err.data_ptr<int64_t>(),
        g.data_ptr<scalar_t>(), dirs.first.data_ptr<scalar_t>(),
        dirs.second.data_ptr<uint8_t>(), w.data_ptr<scalar_t>(), fcw.data_ptr<scalar_t>(),
        out_edge.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    hvp_gather_kernel<scalar_t><<<cuda::grid_for(P, kThreads), kThreads, 0, stream>>>(
        P, h.keep.data_ptr<uint8_t>(), h.pair_edge.data_ptr<int64_t>(),
        out_edge.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cuda(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_local_derivatives";
  check_second_inputs(op, species, pairs, diff_vectors, p, &grad_aev, nullptr);
  TORCH_CHECK(columns.dim() == 1 && (columns.scalar_type() == at::kLong ||
                                     columns.scalar_type() == at::kInt),
              op, ": columns must be a 1-D int64 tensor, got ", columns.scalar_type(), " ",
              columns.sizes());
  c10::cuda::CUDAGuard guard(diff_vectors.device());
  const int64_t F = aev_length(p), C = columns.numel();
  auto sp = species.to(at::kLong).contiguous();
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto g = grad_aev.to(diff.scalar_type()).contiguous();
  // An index list: accepted on any device.
  auto cols = columns.to(diff.device(), at::kLong).contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  at::Tensor local_atoms, jac, curv;
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_local_derivatives_cuda", [&] {
    ParamTensors<scalar_t> pt(p, diff.scalar_type());
    DeviceConsts<scalar_t> dc(p, pt.p, diff.scalar_type());
    Edges h = build_edges(pt.p, sp, pr, diff);
    const auto lopt = sp.options();
    auto ids = at::empty({2, h.E}, lopt);  // pair, neighbour atom
    auto slot = at::empty({2, h.E}, lopt);  // first pair (scratch), slot
    auto count = at::ones({N}, lopt);
    auto stream = at::cuda::getCurrentCUDAStream();
    const auto hv = edge_view<scalar_t>(h, ids[0].data_ptr<int64_t>(), ids[1].data_ptr<int64_t>());
    if (P > 0) {
      edge_ids_kernel<<<cuda::grid_for(P, kThreads), kThreads, 0, stream>>>(
          P, pr.data_ptr<int64_t>(), h.keep.data_ptr<uint8_t>(),
          h.pair_edge.data_ptr<int64_t>(), ids[0].data_ptr<int64_t>(),
          ids[1].data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (N > 0) {
      slots_kernel<scalar_t><<<cuda::grid_for(N, kSecondThreads), kSecondThreads, 0, stream>>>(
          hv, N, p.num_species, sp.data_ptr<int64_t>(), slot[0].data_ptr<int64_t>(),
          slot[1].data_ptr<int64_t>(), count.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    // The one host synchronisation: K (the output shapes) and the value checks
    // the CPU makes (columns, species, pair indices), read back together.
    auto increasing = at::ones({C}, cols.options().dtype(at::kBool));
    if (C > 1)
      increasing.narrow(0, 1, C - 1).copy_(cols.narrow(0, 1, C - 1).gt(cols.narrow(0, 0, C - 1)));
    const auto bad_col = cols.lt(0).logical_or(cols.ge(F)).logical_or(increasing.logical_not());
    const auto bad_sp = sp.reshape({-1}).lt(-1).logical_or(sp.reshape({-1}).ge(p.num_species));
    const auto col_at = first_true(bad_col), sp_at = first_true(bad_sp);
    const auto info = at::stack({at::cat({count, at::ones({1}, lopt)}).max(), h.err.reshape({}),
                                 col_at, value_at(cols, col_at), sp_at,
                                 value_at(sp.reshape({-1}), sp_at)})
                          .cpu();
    const int64_t* in = info.data_ptr<int64_t>();
    TORCH_CHECK(in[2] == C, op, ": columns must be increasing AEV columns in [0, ", F, "), got ",
                in[3], " at position ", in[2]);
    TORCH_CHECK(in[4] == N, op, ": species must be -1 (padding) or in [0, ", p.num_species,
                "), got ", in[5], " at flattened atom ", in[4]);
    TORCH_CHECK(in[1] == 0, op, ": pairs must index the ", N, " flattened atoms");
    const int64_t K = in[0];
    local_atoms = at::full({N, K}, -1, lopt);
    jac = at::zeros({N, K, 3, C}, diff.options());
    curv = at::zeros({N, K, 3, K, 3}, diff.options());
    if (N == 0) return;
    auto colmap = at::full({F}, -1, lopt);
    if (C > 0) {
      colmap_kernel<<<cuda::grid_for(C, kThreads), kThreads, 0, stream>>>(
          C, F, cols.data_ptr<int64_t>(), colmap.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    auto w = at::empty({N, aev_math::angular_scratch_len(dc.view)}, diff.options());
    auto fcw = at::empty({h.E, 3}, diff.options());
    local_kernel<scalar_t><<<cuda::grid_for(N, kSecondThreads), kSecondThreads, 0, stream>>>(
        dc.view, hv, N, K, C, sp.data_ptr<int64_t>(), g.data_ptr<scalar_t>(),
        slot[1].data_ptr<int64_t>(), colmap.data_ptr<int64_t>(), w.data_ptr<scalar_t>(),
        fcw.data_ptr<scalar_t>(), local_atoms.data_ptr<int64_t>(), jac.data_ptr<scalar_t>(),
        curv.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {local_atoms, jac, curv};
}

}  // namespace torchani_fast
