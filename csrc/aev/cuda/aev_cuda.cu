// CUDA AEV from a half neighbour list: forward and backward. The entry points
// run the warp-cooperative kernels of aev/cuda/aev_warp.cuh (the default) or,
// with TORCHANI_FAST_CUDA_AEV=old, the kernels below.
//
// Same half-edge scheme as the CPU kernels (aev/aev_cpu.cpp): each kept pair
// becomes two half edges, one owned by each atom, grouped per atom in CSR form.
// A centre atom is handled by G warps (G = 8 for tiny systems, 1 for large
// ones, so that small molecules still fill the GPU); inside a warp the lanes
// own AEV columns, so every column is accumulated by one lane in a fixed order
// and no atomics touch floating-point data. The result is the same bits on
// every run for a given input shape.
//
//   build_edges        the half edges of each atom, sorted, with their vectors,
//                      lengths and cutoffs (aev/cuda/edges.cuh, shared with the
//                      second-derivative kernels of aev/cuda/second_cuda.cu)
//   forward_kernel     G warps per atom; radial then angular triples; the G
//                      partial rows (shared memory) are summed in fixed order
//   backward_kernel    G warps per atom write d(loss)/d(half edge vector) into
//                      their own copy of a (G, E, 3) buffer: plain
//                      read-modify-writes, since each half edge belongs to one
//                      atom and each copy to one warp
//   gather_kernel      thread per pair: grad_diff = g[edge of i1] - g[edge of i0]
//
// Nothing is read back to the host: every buffer size follows from the input
// shapes (at most 2P half edges). Value errors that the CPU reports with a
// message need a sync to report, so on CUDA they poison the output instead:
// a species outside [-1, num_species) gives that atom a NaN row, and a pair
// index >= M*A makes the whole AEV NaN.
#include "aev/cuda/edges.cuh"
#include "common/cuda_common.cuh"
#include "ops.h"

namespace torchani_fast {
namespace {

// ---------------------------------------------------------------------------
// Launch geometry shared by forward and backward

struct Geometry {
  int G;                // warps per centre atom
  int atoms_per_block;  // atoms handled by one block at a time
  int threads;
  size_t smem;
  int64_t blocks;
};

// Warps per atom from the number of atoms only (not the device), so a given
// input always gives the same bits. rows_per_atom: shared rows per atom (G for
// forward, one per warp; 1 for backward, the staged gradient row).
template <typename scalar_t>
Geometry make_geometry(const Params<scalar_t>& k, int64_t N, bool forward) {
  Geometry g;
  g.G = N >= 4096 ? 1 : N >= 1024 ? 2 : N >= 256 ? 4 : 8;
  const int warps = g.G >= 4 ? g.G : 4;
  g.atoms_per_block = warps / g.G;
  g.threads = warps * kWarp;
  const int64_t rows = forward ? warps : g.atoms_per_block;
  g.smem = static_cast<size_t>(2 * k.R + 5 * k.AZ + rows * k.F) * sizeof(scalar_t);
  g.blocks = cuda::ceil_div(N, g.atoms_per_block);
  return g;
}

// Allows more than the default 48 KiB of dynamic shared memory when needed.
// The attribute is set once per kernel and device (it is not a stream
// operation, so it is also safe while a CUDA graph is being captured).
template <typename Kernel>
void reserve_smem(const char* op, Kernel kernel, size_t bytes, int64_t F) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(bytes <= prop->sharedMemPerBlockOptin, op, ": AEV length ", F,
              " needs ", bytes, " bytes of shared memory per block, more than the ",
              prop->sharedMemPerBlockOptin, " this GPU offers");
  if (bytes <= 48 * 1024) return;
  static size_t reserved[64] = {};
  const int dev = at::cuda::current_device();
  if (dev < 64 && reserved[dev] >= bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  if (dev < 64) reserved[dev] = bytes;
}

// Constants in shared memory: radial (eta, shift) per shift, angular (eta,
// shift, zeta, cos, sin) per column a*Z + z.
template <typename scalar_t>
struct SharedConsts {
  scalar_t *eta_r, *shf_r, *eta_a, *shf_a, *zeta, *cos_z, *sin_z;

  __device__ SharedConsts(const Params<scalar_t>& k, scalar_t* smem) {
    eta_r = smem;
    shf_r = eta_r + k.R;
    eta_a = shf_r + k.R;
    shf_a = eta_a + k.AZ;
    zeta = shf_a + k.AZ;
    cos_z = zeta + k.AZ;
    sin_z = cos_z + k.AZ;
    for (int64_t s = threadIdx.x; s < k.R; s += blockDim.x) {
      eta_r[s] = k.eta_r[k.n_eta_r == 1 ? 0 : s];
      shf_r[s] = k.shf_r[s];
    }
    for (int64_t f = threadIdx.x; f < k.AZ; f += blockDim.x) {
      const int64_t a = f / k.Z, z = f % k.Z;
      eta_a[f] = k.eta_a[k.n_eta_a == 1 ? 0 : a];
      shf_a[f] = k.shf_a[a];
      zeta[f] = k.zeta[k.n_zeta == 1 ? 0 : z];
      cos_z[f] = cuda::dcos(k.sections[z]);
      sin_z[f] = cuda::dsin(k.sections[z]);
    }
  }
  __device__ scalar_t* end(const Params<scalar_t>& k) const { return sin_z + k.AZ; }
};

// The parts of one angular triple shared by forward and backward.
template <typename scalar_t>
struct Triple {
  scalar_t cos_raw;  // v1.v2 / max(r1 r2, 1e-10)
  scalar_t c;        // 0.95 * cos_raw, so |c| <= 0.95
  scalar_t sin_c;    // sqrt(1 - c^2) = sin(acos(c))
  scalar_t mean_r;   // (r1 + r2) / 2
  bool clamped;      // r1 r2 < 1e-10

  __device__ Triple(const scalar_t* e1, const scalar_t* e2) {
    const scalar_t dot = e1[kVx] * e2[kVx] + e1[kVy] * e2[kVy] + e1[kVz] * e2[kVz];
    const scalar_t den = e1[kR] * e2[kR];
    clamped = den < scalar_t(1e-10);
    cos_raw = dot / (clamped ? scalar_t(1e-10) : den);
    c = scalar_t(0.95) * cos_raw;
    const scalar_t one_minus = scalar_t(1) - c * c;
    sin_c = cuda::dsqrt(one_minus > scalar_t(0) ? one_minus : scalar_t(0));
    mean_r = (e1[kR] + e2[kR]) / scalar_t(2);
  }
};

// ---------------------------------------------------------------------------
// Forward

template <typename scalar_t>
__global__ void forward_kernel(Params<scalar_t> k, int64_t N, int G,
                               const int64_t* __restrict__ species,
                               const int64_t* __restrict__ start,
                               const int64_t* __restrict__ ang_count,
                               const scalar_t* __restrict__ data,
                               const int32_t* __restrict__ nspec, const int64_t* __restrict__ err,
                               scalar_t* __restrict__ aev) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const SharedConsts<scalar_t> c(k, reinterpret_cast<scalar_t*>(smem_raw));
  scalar_t* rows = c.end(k);
  __syncthreads();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int apb = blockDim.x / kWarp / G;
  const int la = warp / G, g = warp % G;
  scalar_t* row = rows + static_cast<int64_t>(warp) * k.F;
  const bool failed = err[0] != 0;
  const scalar_t nan = scalar_t(NAN);

  // The loop bound is the same for every thread of the block (__syncthreads inside).
  for (int64_t first = blockIdx.x * int64_t(apb); first < N; first += int64_t(gridDim.x) * apb) {
    const int64_t i = first + la;
    for (int64_t f = lane; f < k.F; f += kWarp) row[f] = scalar_t(0);
    __syncwarp();
    const int64_t s_i = i < N ? species[i] : -1;
    if (!failed && s_i >= 0 && s_i < k.S) {
      const int64_t e0 = start[i], ne = start[i + 1] - e0, na = ang_count[i];
      for (int64_t q = g; q < ne; q += G) {
        const scalar_t* e = data + kEdgeFields * (e0 + q);
        const scalar_t r = e[kR], fc = e[kFcR];
        scalar_t* out = row + static_cast<int64_t>(nspec[e0 + q]) * k.R;
        for (int64_t s = lane; s < k.R; s += kWarp) {
          const scalar_t x = r - c.shf_r[s];
          // TorchANI's radial terms carry a factor 0.25.
          out[s] += scalar_t(0.25) * cuda::dexp(-c.eta_r[s] * x * x) * fc;
        }
      }
      // Triple t (j < l, row-major) belongs to warp t % G: row j starts at
      // triple t0, so this warp's first l in it is j + 1 + (g - t0) mod G.
      int first_l = 1 + g;  // for row 0 (t0 = 0)
      for (int j = 0; j < na; ++j) {
        const scalar_t* e1 = data + kEdgeFields * (e0 + j);
        const int32_t s1 = nspec[e0 + j];
        int l = first_l;
        for (; l < na; l += G) {
          const scalar_t* e2 = data + kEdgeFields * (e0 + l);
          const Triple<scalar_t> tr(e1, e2);
          const scalar_t fcc = e1[kFcA] * e2[kFcA];
          scalar_t* out = row + k.radial_len + pair_index(s1, nspec[e0 + l], k.S) * k.AZ;
          for (int64_t f = lane; f < k.AZ; f += kWarp) {
            // 2 ((1 + cos(acos(0.95 cos t) - ts)) / 2)^zeta, with
            // cos(acos(c) - ts) = c cos(ts) + sqrt(1 - c^2) sin(ts).
            const scalar_t cdev = tr.c * c.cos_z[f] + tr.sin_c * c.sin_z[f];
            const scalar_t f1 =
                scalar_t(2) * cuda::dpow((scalar_t(1) + cdev) / scalar_t(2), c.zeta[f]);
            const scalar_t x = tr.mean_r - c.shf_a[f];
            const scalar_t f2 = cuda::dexp(-c.eta_a[f] * x * x) * fcc;
            out[f] += f2 * f1;
          }
        }
        first_l = j + 2 + (l - na);  // the overshoot carries into the next rows
      }
    }
    __syncthreads();
    // Sum the G partial rows of each atom in a fixed order and store the row.
    const int64_t mine = first + threadIdx.x / (G * kWarp);
    if (threadIdx.x < apb * G * kWarp && mine < N) {
      const int64_t s_m = species[mine];
      const bool bad = failed || s_m < -1 || s_m >= k.S;
      const scalar_t* part = rows + static_cast<int64_t>(threadIdx.x / (G * kWarp)) * G * k.F;
      for (int64_t f = threadIdx.x % (G * kWarp); f < k.F; f += G * kWarp) {
        scalar_t v = part[f];
        for (int h = 1; h < G; ++h) v += part[h * k.F + f];
        aev[mine * k.F + f] = bad ? nan : v;
      }
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// Backward

template <typename scalar_t>
__global__ void backward_kernel(Params<scalar_t> k, int64_t N, int G, int64_t E,
                                const int64_t* __restrict__ species,
                                const int64_t* __restrict__ start,
                                const int64_t* __restrict__ ang_count,
                                const scalar_t* __restrict__ data,
                                const int32_t* __restrict__ nspec,
                                const int64_t* __restrict__ err,
                                const scalar_t* __restrict__ grad_aev,
                                scalar_t* __restrict__ grad_edge) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const SharedConsts<scalar_t> c(k, reinterpret_cast<scalar_t*>(smem_raw));
  scalar_t* grows = c.end(k);
  __syncthreads();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int apb = blockDim.x / kWarp / G;
  const int la = warp / G, g = warp % G;
  const scalar_t* grow = grows + static_cast<int64_t>(la) * k.F;
  // This warp's copy of the half-edge gradients.
  scalar_t* ge = grad_edge + static_cast<int64_t>(g) * E * 3;
  const bool failed = err[0] != 0;

  for (int64_t first = blockIdx.x * int64_t(apb); first < N; first += int64_t(gridDim.x) * apb) {
    const int64_t i = first + la;
    // Stage this atom's incoming gradient row (all G warps of the atom help).
    if (i < N)
      for (int64_t f = g * kWarp + lane; f < k.F; f += G * kWarp)
        grows[static_cast<int64_t>(la) * k.F + f] = grad_aev[i * k.F + f];
    __syncthreads();
    const int64_t s_i = i < N ? species[i] : -1;
    if (!failed && s_i >= 0 && s_i < k.S) {
      const int64_t e0 = start[i], ne = start[i + 1] - e0, na = ang_count[i];
      for (int64_t q = g; q < ne; q += G) {
        const scalar_t* e = data + kEdgeFields * (e0 + q);
        const scalar_t r = e[kR], fc = e[kFcR], dfc = e[kDfcR];
        const scalar_t* gs = grow + static_cast<int64_t>(nspec[e0 + q]) * k.R;
        scalar_t part = 0;
        for (int64_t s = lane; s < k.R; s += kWarp) {
          const scalar_t x = r - c.shf_r[s];
          const scalar_t ex = scalar_t(0.25) * cuda::dexp(-c.eta_r[s] * x * x);
          part += gs[s] * ex * (dfc - scalar_t(2) * c.eta_r[s] * x * fc);
        }
        const scalar_t dr = warp_sum(part);
        // Coincident atoms: the direction is undefined, no gradient.
        if (r > scalar_t(0) && lane < 3) ge[3 * (e0 + q) + lane] += dr * e[kVx + lane] / r;
      }
      // The triples of this warp, as in forward_kernel.
      int first_l = 1 + g;
      for (int j = 0; j < na; ++j) {
        const scalar_t* e1 = data + kEdgeFields * (e0 + j);
        const int32_t s1 = nspec[e0 + j];
        scalar_t acc0 = 0, acc1 = 0, acc2 = 0;  // gradient of half edge j
        int l = first_l;
        for (; l < na; l += G) {
          const scalar_t* e2 = data + kEdgeFields * (e0 + l);
          const Triple<scalar_t> tr(e1, e2);
          const scalar_t* gs = grow + k.radial_len + pair_index(s1, nspec[e0 + l], k.S) * k.AZ;
          scalar_t s_val = 0, s_dc = 0, s_dm = 0;
          for (int64_t f = lane; f < k.AZ; f += kWarp) {
            const scalar_t cdev = tr.c * c.cos_z[f] + tr.sin_c * c.sin_z[f];
            const scalar_t base = (scalar_t(1) + cdev) / scalar_t(2);
            const scalar_t f1 = scalar_t(2) * cuda::dpow(base, c.zeta[f]);
            // d cos(acos(c) - ts)/dc = cos(ts) - c / sqrt(1 - c^2) * sin(ts)
            const scalar_t dcdev = c.cos_z[f] - tr.c / tr.sin_c * c.sin_z[f];
            const scalar_t df1 = c.zeta[f] * cuda::dpow(base, c.zeta[f] - scalar_t(1)) * dcdev;
            const scalar_t x = tr.mean_r - c.shf_a[f];
            const scalar_t f2 = cuda::dexp(-c.eta_a[f] * x * x);
            const scalar_t df2 = scalar_t(-2) * c.eta_a[f] * x * f2;
            const scalar_t gf = gs[f];
            s_val += gf * f1 * f2;
            s_dm += gf * f1 * df2;
            s_dc += gf * df1 * f2;
          }
          s_val = warp_sum(s_val);
          s_dm = warp_sum(s_dm);
          s_dc = warp_sum(s_dc);
          const scalar_t fc1 = e1[kFcA], fc2 = e2[kFcA];
          const scalar_t fcc = fc1 * fc2;
          // d/d(cos_raw) through c = 0.95 cos_raw; d/dr_i through the mean
          // distance (factor 1/2) and through the cutoff of that neighbour.
          const scalar_t d_cos = scalar_t(0.95) * fcc * s_dc;
          const scalar_t d_r1 = scalar_t(0.5) * fcc * s_dm + s_val * e1[kDfcA] * fc2;
          const scalar_t d_r2 = scalar_t(0.5) * fcc * s_dm + s_val * fc1 * e2[kDfcA];
          const scalar_t r1 = e1[kR], r2 = e2[kR];
          scalar_t g1[3], g2[3];
          if (tr.clamped) {
            const scalar_t inv = scalar_t(1e10);
            for (int d = 0; d < 3; ++d) {
              g1[d] = d_cos * e2[kVx + d] * inv;
              g2[d] = d_cos * e1[kVx + d] * inv;
            }
          } else {
            const scalar_t inv = scalar_t(1) / (r1 * r2);
            for (int d = 0; d < 3; ++d) {
              g1[d] = d_cos * (e2[kVx + d] * inv - tr.cos_raw * e1[kVx + d] / (r1 * r1));
              g2[d] = d_cos * (e1[kVx + d] * inv - tr.cos_raw * e2[kVx + d] / (r2 * r2));
            }
          }
          if (r1 > scalar_t(0))
            for (int d = 0; d < 3; ++d) g1[d] += d_r1 * e1[kVx + d] / r1;
          if (r2 > scalar_t(0))
            for (int d = 0; d < 3; ++d) g2[d] += d_r2 * e2[kVx + d] / r2;
          acc0 += g1[0];
          acc1 += g1[1];
          acc2 += g1[2];
          if (lane < 3) ge[3 * (e0 + l) + lane] += lane == 0 ? g2[0] : lane == 1 ? g2[1] : g2[2];
        }
        if (lane < 3) ge[3 * (e0 + j) + lane] += lane == 0 ? acc0 : lane == 1 ? acc1 : acc2;
        first_l = j + 2 + (l - na);
      }
    }
    __syncthreads();
  }
}

// Back from half edges to pairs: the centre-to-neighbour vector is -diff for
// the half edge owned by i0 and +diff for the one owned by i1.
template <typename scalar_t>
__global__ void gather_kernel(int64_t P, int64_t E, int G, const uint8_t* __restrict__ keep,
                              const int64_t* __restrict__ pair_edge,
                              const scalar_t* __restrict__ grad_edge,
                              scalar_t* __restrict__ grad_diff) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P;
       p += int64_t(gridDim.x) * blockDim.x) {
    scalar_t out[3] = {0, 0, 0};
    if (keep[p] != 0) {
      const int64_t a = pair_edge[2 * p], b = pair_edge[2 * p + 1];
      for (int d = 0; d < 3; ++d) {
        scalar_t ga = 0, gb = 0;
        for (int h = 0; h < G; ++h) {
          ga += grad_edge[(h * E + a) * 3 + d];
          gb += grad_edge[(h * E + b) * 3 + d];
        }
        out[d] = gb - ga;
      }
    }
    for (int d = 0; d < 3; ++d) grad_diff[3 * p + d] = out[d];
  }
}

}  // namespace
}  // namespace torchani_fast

// The warp-cooperative kernels (the default), after the helpers above they share.
#include "aev/cuda/aev_warp.cuh"

namespace torchani_fast {
namespace {

// ---------------------------------------------------------------------------
// Entry points

// The forward, with the handle of its slots when `keep` (warp kernels only;
// the old kernels keep nothing: an empty handle, which the backward ignores).
std::tuple<at::Tensor, at::Tensor> aev_forward_impl(const at::Tensor& species,
                                                    const at::Tensor& pairs,
                                                    const at::Tensor& diff_vectors,
                                                    const AEVParams& p, bool keep) {
  const char* op = "torchani_fast::aev";
  check_aev_inputs(op, species, pairs, diff_vectors, p);
  check_devices(op, species, pairs, diff_vectors, p);
  c10::cuda::CUDAGuard guard(diff_vectors.device());
  auto sp = species.to(at::kLong).contiguous();
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  std::vector<int64_t> out_shape(species.sizes().begin(), species.sizes().end());
  out_shape.push_back(aev_length(p));
  auto aev = at::empty(out_shape, diff.options());
  at::Tensor handle;
  const int64_t N = sp.numel();
  if (N > 0) {
    AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_forward_cuda", [&] {
      ParamTensors<scalar_t> pt(p, diff.scalar_type());
      const auto& k = pt.p;
      if (use_warp_kernels(pr.size(1))) {
        SlotEdges h = build_slots(k, sp, pr, diff);
        warp_forward(op, k, sp, pr, diff, h, aev);
        if (keep) handle = slots_handle(species, pairs, diff_vectors, p, std::move(h));
        return;
      }
      Edges h = build_edges(k, sp, pr, diff);
      const Geometry geo = make_geometry(k, N, /*forward=*/true);
      reserve_smem(op, forward_kernel<scalar_t>, geo.smem, k.F);
      forward_kernel<scalar_t><<<static_cast<unsigned int>(geo.blocks), geo.threads, geo.smem,
                                 at::cuda::getCurrentCUDAStream()>>>(
          k, N, geo.G, sp.data_ptr<int64_t>(), h.start.data_ptr<int64_t>(),
          h.ang_count.data_ptr<int64_t>(), h.data.data_ptr<scalar_t>(),
          h.nspec.data_ptr<int32_t>(), h.err.data_ptr<int64_t>(), aev.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (!handle.defined()) handle = at::empty({0}, diff_vectors.options().dtype(at::kByte));
  return {aev, handle};
}

}  // namespace

at::Tensor aev_forward_cuda(const at::Tensor& species, const at::Tensor& pairs,
                            const at::Tensor& diff_vectors, const AEVParams& p) {
  return std::get<0>(aev_forward_impl(species, pairs, diff_vectors, p, false));
}

std::tuple<at::Tensor, at::Tensor> aev_with_edges_cuda(const at::Tensor& species,
                                                       const at::Tensor& pairs,
                                                       const at::Tensor& diff_vectors,
                                                       const AEVParams& p) {
  return aev_forward_impl(species, pairs, diff_vectors, p, true);
}

at::Tensor aev_backward_edges_cuda(const at::Tensor& grad_aev, const at::Tensor& edges,
                                   const at::Tensor& species, const at::Tensor& pairs,
                                   const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_backward";
  check_aev_inputs(op, species, pairs, diff_vectors, p);
  check_devices(op, species, pairs, diff_vectors, p);
  cuda::check_same_device(op, "grad_aev", grad_aev, diff_vectors.device());
  TORCH_CHECK(grad_aev.numel() == species.numel() * aev_length(p), op,
              ": grad_aev must have shape species.shape + (", aev_length(p), ",), got ",
              grad_aev.sizes());
  c10::cuda::CUDAGuard guard(diff_vectors.device());
  auto sp = species.to(at::kLong).contiguous();
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto g = grad_aev.to(diff.scalar_type()).contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  auto grad_diff = at::empty({P, 3}, diff.options());
  if (P == 0) return grad_diff;
  if (N == 0) return grad_diff.zero_();
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_backward_cuda", [&] {
    ParamTensors<scalar_t> pt(p, diff.scalar_type());
    const auto& k = pt.p;
    if (use_warp_kernels(P)) {
      const SlotEdges* kept = kept_slots(edges, species, pairs, diff_vectors, p);
      SlotEdges built;
      if (!kept) built = build_slots(k, sp, pr, diff);
      warp_backward(op, k, sp, pr, diff, kept ? *kept : built, g, grad_diff);
      return;
    }
    Edges h = build_edges(k, sp, pr, diff);
    const Geometry geo = make_geometry(k, N, /*forward=*/false);
    auto grad_edge = at::zeros({geo.G, h.E, 3}, diff.options());
    auto stream = at::cuda::getCurrentCUDAStream();
    reserve_smem(op, backward_kernel<scalar_t>, geo.smem, k.F);
    backward_kernel<scalar_t><<<static_cast<unsigned int>(geo.blocks), geo.threads, geo.smem,
                                stream>>>(
        k, N, geo.G, h.E, sp.data_ptr<int64_t>(), h.start.data_ptr<int64_t>(),
        h.ang_count.data_ptr<int64_t>(), h.data.data_ptr<scalar_t>(),
        h.nspec.data_ptr<int32_t>(), h.err.data_ptr<int64_t>(), g.data_ptr<scalar_t>(),
        grad_edge.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    gather_kernel<scalar_t><<<cuda::grid_for(P, kThreads), kThreads, 0, stream>>>(
        P, h.E, geo.G, h.keep.data_ptr<uint8_t>(), h.pair_edge.data_ptr<int64_t>(),
        grad_edge.data_ptr<scalar_t>(), grad_diff.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_diff;
}

at::Tensor aev_backward_cuda(const at::Tensor& grad_aev, const at::Tensor& species,
                             const at::Tensor& pairs, const at::Tensor& diff_vectors,
                             const AEVParams& p) {
  return aev_backward_edges_cuda(grad_aev, at::Tensor(), species, pairs, diff_vectors, p);
}

}  // namespace torchani_fast
