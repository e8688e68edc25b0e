// The half-edge layout of the CUDA AEV kernels, built on the device without a
// host synchronisation: shared by aev/cuda/aev_cuda.cu (forward, backward) and
// aev/cuda/second_cuda.cu (second derivatives). Included by .cu files only; its
// contents have internal linkage (each file gets its own copy of the kernels).
//
//   edge_count_kernel  thread per pair: keep? (index >= 0, species >= 0,
//                      r <= Rc_radial), per-atom counts (all and angular)
//   cumsum             CSR starts (at::cumsum, on the stream, no sync)
//   edge_fill_kernel   thread per pair: half edges into their atom's segment
//                      (atomic slot, so the order inside a segment is random)
//   edge_sort_kernel   warp per atom: rank-sort the segment by (not angular,
//                      pair, side), so angular neighbours come first and the
//                      order is canonical; store the centre-to-neighbour vector,
//                      r, cutoff values and neighbour species per half edge
#pragma once

#include "aev/second_derivs.h"
#include "common/cuda_common.cuh"
#include "ops.h"

namespace torchani_fast {
namespace {
using cuda::kWarp;
using cuda::warp_sum;

constexpr int kThreads = 256;
constexpr int64_t kErrPairIndex = 1;

// Per half edge: centre-to-neighbour vector, its length, and the cutoff
// function and its derivative for both cutoffs (0 beyond the angular cutoff).
enum EdgeField { kVx, kVy, kVz, kR, kFcR, kDfcR, kFcA, kDfcA, kEdgeFields };

// Keys sort angular neighbours first, then by pair index and side.
constexpr int kKeyAngularShift = 62;

template <typename scalar_t>
struct Params {
  const scalar_t *eta_r, *shf_r, *eta_a, *zeta, *shf_a, *sections;
  int64_t n_eta_r, n_eta_a, n_zeta;
  int64_t S, R, A, Z, AZ, F, radial_len;
  scalar_t rc_r, rc_a;
  scalar_t rc_r_sq;  // rounded from the double square, as on the CPU
  aev_math::CutoffFn<scalar_t> cut;  // of both terms
};

// Device copies of the constants in the working dtype (no-ops when the
// buffers already have it), kept alive for the duration of the launches.
template <typename scalar_t>
struct ParamTensors {
  at::Tensor eta_r, shf_r, eta_a, zeta, shf_a, sections;
  Params<scalar_t> p;

  ParamTensors(const AEVParams& a, at::ScalarType dtype) {
    auto conv = [&](const at::Tensor& t) { return t.detach().to(dtype).contiguous(); };
    eta_r = conv(a.radial_eta);
    shf_r = conv(a.radial_shifts);
    eta_a = conv(a.angular_eta);
    zeta = conv(a.angular_zeta);
    shf_a = conv(a.angular_shifts);
    sections = conv(a.angular_sections);
    p.eta_r = eta_r.data_ptr<scalar_t>();
    p.shf_r = shf_r.data_ptr<scalar_t>();
    p.eta_a = eta_a.data_ptr<scalar_t>();
    p.zeta = zeta.data_ptr<scalar_t>();
    p.shf_a = shf_a.data_ptr<scalar_t>();
    p.sections = sections.data_ptr<scalar_t>();
    p.n_eta_r = eta_r.numel();
    p.n_eta_a = eta_a.numel();
    p.n_zeta = zeta.numel();
    p.S = a.num_species;
    p.R = shf_r.numel();
    p.A = shf_a.numel();
    p.Z = sections.numel();
    p.AZ = p.A * p.Z;
    p.radial_len = p.S * p.R;
    p.F = p.radial_len + p.S * (p.S + 1) / 2 * p.AZ;
    p.rc_r = static_cast<scalar_t>(a.radial_cutoff);
    p.rc_a = static_cast<scalar_t>(a.angular_cutoff);
    p.rc_r_sq = static_cast<scalar_t>(a.radial_cutoff * a.radial_cutoff);
    p.cut.kind = a.cutoff_kind;
    p.cut.order = a.cutoff_order;
    p.cut.eps = static_cast<scalar_t>(a.cutoff_eps);
  }
};

// The cutoff function and its derivative, as on the CPU (cosf/sinf, cos/sin;
// expf, exp).
using aev_math::cutoff_value;
using aev_math::cutoff_deriv;

// Row-major upper-triangular index of the species pair, as torchani's triu_index.
__device__ __forceinline__ int64_t pair_index(int64_t s1, int64_t s2, int64_t S) {
  if (s1 > s2) {
    const int64_t t = s1;
    s1 = s2;
    s2 = t;
  }
  return s1 * S - s1 * (s1 - 1) / 2 + (s2 - s1);
}

// ---------------------------------------------------------------------------
// Half-edge construction

template <typename scalar_t>
__global__ void edge_count_kernel(const int64_t* __restrict__ species, int64_t N, int64_t S,
                                  const int64_t* __restrict__ pairs, int64_t P,
                                  const scalar_t* __restrict__ diff, scalar_t rc_r_sq,
                                  scalar_t rc_a, uint8_t* __restrict__ keep,
                                  int64_t* __restrict__ count, int64_t* __restrict__ ang_count,
                                  int64_t* __restrict__ err) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P;
       p += int64_t(gridDim.x) * blockDim.x) {
    uint8_t k = 0;
    const int64_t a = pairs[p], b = pairs[P + p];
    // A negative index marks an unused slot of a fixed-capacity pair list.
    if (a >= 0 && b >= 0) {
      if (a >= N || b >= N) {
        cuda::atomic_or_i64(err, kErrPairIndex);
      } else {
        const int64_t sa = species[a], sb = species[b];
        if (sa >= 0 && sb >= 0 && sa < S && sb < S) {
          const scalar_t* d = diff + 3 * p;
          const scalar_t r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
          if (r2 <= rc_r_sq) {
            const bool ang = cuda::dsqrt(r2) <= rc_a;
            k = ang ? 2 : 1;
            cuda::atomic_add_i64(count + a, 1);
            cuda::atomic_add_i64(count + b, 1);
            if (ang) {
              cuda::atomic_add_i64(ang_count + a, 1);
              cuda::atomic_add_i64(ang_count + b, 1);
            }
          }
        }
      }
    }
    keep[p] = k;
  }
}

__global__ void edge_fill_kernel(const int64_t* __restrict__ pairs, int64_t P,
                                 const uint8_t* __restrict__ keep,
                                 const int64_t* __restrict__ start, int64_t* __restrict__ cursor,
                                 int64_t* __restrict__ key) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P;
       p += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t k = keep[p];
    if (k == 0) continue;
    const int64_t not_ang = k == 2 ? 0 : 1;
    const int64_t base = (not_ang << kKeyAngularShift) | (p << 1);
    const int64_t a = pairs[p], b = pairs[P + p];
    key[start[a] + cuda::atomic_add_i64(cursor + a, 1)] = base;
    key[start[b] + cuda::atomic_add_i64(cursor + b, 1)] = base | 1;
  }
}

template <typename scalar_t>
__global__ void edge_sort_kernel(Params<scalar_t> k, const int64_t* __restrict__ species, int64_t N,
                                 const int64_t* __restrict__ pairs, int64_t P,
                                 const scalar_t* __restrict__ diff,
                                 const int64_t* __restrict__ start,
                                 const int64_t* __restrict__ key, scalar_t* __restrict__ data,
                                 int32_t* __restrict__ nspec, int64_t* __restrict__ pair_edge) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x / kWarp) + threadIdx.x / kWarp; i < N;
       i += warps) {
    const int64_t s = start[i], n = start[i + 1] - s;
    for (int64_t q = lane; q < n; q += kWarp) {
      const int64_t mine = key[s + q];
      int64_t rank = 0;
      for (int64_t o = 0; o < n; ++o) rank += key[s + o] < mine;
      const int64_t pos = s + rank;
      const int64_t p = (mine & ((int64_t(1) << kKeyAngularShift) - 1)) >> 1;
      const int side = static_cast<int>(mine & 1);
      // diff = x[i0] - x[i1]: the vector from the centre to the neighbour is
      // -diff when the centre is i0 and +diff when it is i1.
      const scalar_t sign = side == 0 ? scalar_t(-1) : scalar_t(1);
      scalar_t* e = data + kEdgeFields * pos;
      const scalar_t v0 = sign * diff[3 * p], v1 = sign * diff[3 * p + 1],
                     v2 = sign * diff[3 * p + 2];
      const scalar_t r = cuda::dsqrt(v0 * v0 + v1 * v1 + v2 * v2);
      e[kVx] = v0;
      e[kVy] = v1;
      e[kVz] = v2;
      e[kR] = r;
      e[kFcR] = cutoff_value(k.cut, r, k.rc_r);
      e[kDfcR] = cutoff_deriv(k.cut, r, k.rc_r);
      const bool ang = (mine >> kKeyAngularShift) == 0;
      e[kFcA] = ang ? cutoff_value(k.cut, r, k.rc_a) : scalar_t(0);
      e[kDfcA] = ang ? cutoff_deriv(k.cut, r, k.rc_a) : scalar_t(0);
      nspec[pos] = static_cast<int32_t>(species[side == 0 ? pairs[P + p] : pairs[p]]);
      pair_edge[2 * p + side] = pos;
    }
  }
}

// Zero-filled integer workspace and the sorted half edges of one call.
struct Edges {
  int64_t N, P, E;  // E = 2P, the most half edges there can be
  at::Tensor ints, start, count, ang_count, cursor, err;
  at::Tensor keep, key, data, nspec, pair_edge;
};

template <typename scalar_t>
Edges build_edges(const Params<scalar_t>& k, const at::Tensor& sp, const at::Tensor& pr,
                  const at::Tensor& diff) {
  Edges h;
  h.N = sp.numel();
  h.P = pr.size(1);
  h.E = 2 * h.P;
  const auto lopt = sp.options().dtype(at::kLong);
  // start (N+1) | count (N) | ang_count (N) | cursor (N) | err (1): one memset.
  h.ints = at::zeros({4 * h.N + 2}, lopt);
  h.start = h.ints.narrow(0, 0, h.N + 1);
  h.count = h.ints.narrow(0, h.N + 1, h.N);
  h.ang_count = h.ints.narrow(0, 2 * h.N + 1, h.N);
  h.cursor = h.ints.narrow(0, 3 * h.N + 1, h.N);
  h.err = h.ints.narrow(0, 4 * h.N + 1, 1);
  h.keep = at::empty({h.P}, sp.options().dtype(at::kByte));
  h.key = at::empty({h.E}, lopt);
  h.data = at::empty({h.E, kEdgeFields}, diff.options());
  h.nspec = at::empty({h.E}, sp.options().dtype(at::kInt));
  h.pair_edge = at::empty({h.P, 2}, lopt);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (h.P > 0) {
    edge_count_kernel<scalar_t><<<cuda::grid_for(h.P, kThreads), kThreads, 0, stream>>>(
        sp.data_ptr<int64_t>(), h.N, k.S, pr.data_ptr<int64_t>(), h.P, diff.data_ptr<scalar_t>(),
        k.rc_r_sq, k.rc_a, h.keep.data_ptr<uint8_t>(), h.count.data_ptr<int64_t>(),
        h.ang_count.data_ptr<int64_t>(), h.err.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (h.N > 0) {
    auto ends = h.start.narrow(0, 1, h.N);
    at::cumsum_out(ends, h.count, 0);
  }
  if (h.P > 0) {
    edge_fill_kernel<<<cuda::grid_for(h.P, kThreads), kThreads, 0, stream>>>(
        pr.data_ptr<int64_t>(), h.P, h.keep.data_ptr<uint8_t>(), h.start.data_ptr<int64_t>(),
        h.cursor.data_ptr<int64_t>(), h.key.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    edge_sort_kernel<scalar_t>
        <<<cuda::grid_for(h.N * kWarp, kThreads), kThreads, 0, stream>>>(
            k, sp.data_ptr<int64_t>(), h.N, pr.data_ptr<int64_t>(), h.P,
            diff.data_ptr<scalar_t>(), h.start.data_ptr<int64_t>(), h.key.data_ptr<int64_t>(),
            h.data.data_ptr<scalar_t>(), h.nspec.data_ptr<int32_t>(),
            h.pair_edge.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return h;
}



void check_devices(const char* op, const at::Tensor& species, const at::Tensor& pairs,
                   const at::Tensor& diff, const AEVParams& p) {
  const at::Device device = diff.device();
  cuda::check_same_device(op, "species", species, device);
  cuda::check_same_device(op, "pairs", pairs, device);
  cuda::check_same_device(op, "radial_eta", p.radial_eta, device);
  cuda::check_same_device(op, "radial_shifts", p.radial_shifts, device);
  cuda::check_same_device(op, "angular_eta", p.angular_eta, device);
  cuda::check_same_device(op, "angular_zeta", p.angular_zeta, device);
  cuda::check_same_device(op, "angular_shifts", p.angular_shifts, device);
  cuda::check_same_device(op, "angular_sections", p.angular_sections, device);
}

int64_t aev_length(const AEVParams& p) {
  const int64_t S = p.num_species;
  return S * p.radial_shifts.numel() +
         S * (S + 1) / 2 * p.angular_shifts.numel() * p.angular_sections.numel();
}


}  // namespace
}  // namespace torchani_fast
