// pair_vectors and its backward scatter on CUDA, with the CPU kernels'
// arithmetic (neighbors_cpu.cpp), and no floating-point atomics: the forces
// are the same bits on every run.
//
//   pair_vectors          one thread per pair: the vector and its length.
//   pair_vectors_backward each atom sums its own half edges in pair order, as
//                         the serial CPU loop does (so the bits equal the
//                         CPU's): edge_kernel files the half edges of each
//                         pair under its two atoms (an integer atomic picks
//                         the slot of a row of kEdges per atom), then
//                         gather_kernel sorts each atom's row by pair index
//                         and adds (+grad for the first atom, -grad for the
//                         second). An atom with more than kEdges half edges
//                         reads the whole pair list instead, in order.
//
// Pairs are not checked on the host (that would read them back): (-1, -1), the
// padding of neighbor_pairs_padded, gives a zero vector and no gradient; any
// other index outside [0, N) gives NaN vectors, and NaN gradients for every
// atom, never a silent wrong value.
#include "common/cuda_common.cuh"
#include "ops.h"

namespace torchani_fast {
namespace {

constexpr int kThreads = 128;
// Half edges per atom's row: ANI's cutoff gives ~60 in a liquid.
constexpr int kEdges = 96;

template <typename scalar_t>
__global__ void pair_vectors_kernel(int64_t P, int64_t N, const scalar_t* __restrict__ x,
                                    const int64_t* __restrict__ pairs,
                                    const scalar_t* __restrict__ img, const scalar_t* __restrict__ C,
                                    scalar_t* __restrict__ d, scalar_t* __restrict__ r) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = pairs[p], j = pairs[P + p];
    scalar_t v[3] = {0, 0, 0};
    if (i >= 0 && i < N && j >= 0 && j < N) {
      const scalar_t* xi = x + 3 * i;
      const scalar_t* xj = x + 3 * j;
      for (int c = 0; c < 3; ++c) v[c] = xi[c] - xj[c];
      if (C != nullptr) {
        const scalar_t* n = img + 3 * p;
        for (int c = 0; c < 3; ++c) v[c] += n[0] * C[c] + n[1] * C[3 + c] + n[2] * C[6 + c];
      }
    } else if (!(i == -1 && j == -1)) {
      for (int c = 0; c < 3; ++c) v[c] = NAN;
    }
    for (int c = 0; c < 3; ++c) d[3 * p + c] = v[c];
    r[p] = cuda::dsqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
  }
}

template <typename scalar_t>
__device__ __forceinline__ bool zero_grad(const scalar_t* g) {
  return g[0] == scalar_t(0) && g[1] == scalar_t(0) && g[2] == scalar_t(0);
}

// count[a] (a < N): half edges of atom a; count[N] != 0: a pair outside [0, N).
// A zero gradient is skipped (it adds nothing, at most the sign of a zero).
template <typename scalar_t>
__global__ void edge_kernel(int64_t P, int64_t N, const int64_t* __restrict__ pairs,
                            const scalar_t* __restrict__ g, int64_t* __restrict__ count,
                            int64_t* __restrict__ edges) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t ends[2] = {pairs[p], pairs[P + p]};
    if (!(ends[0] >= 0 && ends[0] < N && ends[1] >= 0 && ends[1] < N)) {
      if (!(ends[0] == -1 && ends[1] == -1)) cuda::atomic_or_i64(count + N, 1);
      continue;
    }
    if (zero_grad(g + 3 * p)) continue;
    for (int e = 0; e < 2; ++e) {
      const int64_t slot = cuda::atomic_add_i64(count + ends[e], 1);
      if (slot < kEdges) edges[ends[e] * kEdges + slot] = 2 * p + e;
    }
  }
}

template <typename scalar_t>
__global__ void gather_kernel(int64_t P, int64_t N, const int64_t* __restrict__ pairs,
                              const scalar_t* __restrict__ g, const int64_t* __restrict__ count,
                              int64_t* __restrict__ edges, scalar_t* __restrict__ out) {
  const bool bad = count[N] != 0;
  for (int64_t a = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; a < N;
       a += int64_t(gridDim.x) * blockDim.x) {
    scalar_t acc[3] = {0, 0, 0};
    const int64_t n = count[a];
    if (bad) {
      for (int c = 0; c < 3; ++c) acc[c] = NAN;
    } else if (n <= kEdges) {
      int64_t* row = edges + a * kEdges;
      for (int64_t s = 1; s < n; ++s) {  // pair order (and first before second)
        const int64_t e = row[s];
        int64_t q = s;
        for (; q > 0 && row[q - 1] > e; --q) row[q] = row[q - 1];
        row[q] = e;
      }
      for (int64_t s = 0; s < n; ++s) {
        const int64_t e = row[s];
        const scalar_t* gp = g + 3 * (e / 2);
        if (e % 2 == 0)
          for (int c = 0; c < 3; ++c) acc[c] += gp[c];
        else
          for (int c = 0; c < 3; ++c) acc[c] -= gp[c];
      }
    } else {  // an overflowed row: the whole list, in order
      for (int64_t p = 0; p < P; ++p) {
        const scalar_t* gp = g + 3 * p;
        if (zero_grad(gp)) continue;
        if (pairs[p] == a)
          for (int c = 0; c < 3; ++c) acc[c] += gp[c];
        if (pairs[P + p] == a)
          for (int c = 0; c < 3; ++c) acc[c] -= gp[c];
      }
    }
    for (int c = 0; c < 3; ++c) out[3 * a + c] = acc[c];
  }
}

void check_pairs(const char* op, const at::Tensor& pairs, const at::Device& device) {
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(0) == 2 && pairs.scalar_type() == at::kLong, op,
              ": pairs must be an int64 (2, pairs) tensor, got ", pairs.scalar_type(), " ",
              pairs.sizes());
  cuda::check_same_device(op, "pairs", pairs, device);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> pair_vectors_cuda(const at::Tensor& coords,
                                                     const at::Tensor& pairs,
                                                     const c10::optional<at::Tensor>& images,
                                                     const c10::optional<at::Tensor>& cell) {
  const char* op = "torchani_fast::pair_vectors";
  TORCH_CHECK(coords.dim() == 2 && coords.size(1) == 3 && at::isFloatingType(coords.scalar_type()),
              op, ": coords must be a float (atoms, 3) tensor, got ", coords.scalar_type(), " ",
              coords.sizes());
  const at::Device device = coords.device();
  check_pairs(op, pairs, device);
  TORCH_CHECK(images.has_value() == cell.has_value(), op,
              ": images and cell must be given together (both or neither)");
  const int64_t P = pairs.size(1), N = coords.size(0);
  if (cell.has_value()) {
    TORCH_CHECK(cell->dim() == 2 && cell->size(0) == 3 && cell->size(1) == 3 &&
                    cell->scalar_type() == coords.scalar_type(),
                op, ": cell must be a (3, 3) tensor of the coords' dtype, got ",
                cell->scalar_type(), " ", cell->sizes());
    TORCH_CHECK(images->dim() == 2 && images->size(0) == P && images->size(1) == 3 &&
                    images->scalar_type() == coords.scalar_type(),
                op, ": images must be a (", P, ", 3) tensor of the coords' dtype, got ",
                images->scalar_type(), " ", images->sizes());
    cuda::check_same_device(op, "cell", *cell, device);
    cuda::check_same_device(op, "images", *images, device);
  }
  c10::cuda::CUDAGuard guard(device);
  at::Tensor diff = at::empty({P, 3}, coords.options());
  at::Tensor dist = at::empty({P}, coords.options());
  if (P == 0) return {diff, dist};
  const at::Tensor x = coords.contiguous(), idx = pairs.contiguous();
  at::Tensor img, C;
  if (cell.has_value()) {
    img = images->contiguous();
    C = cell->contiguous();
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(coords.scalar_type(), "pair_vectors_cuda", [&] {
    pair_vectors_kernel<scalar_t><<<cuda::grid_for(P, kThreads), kThreads, 0, stream>>>(
        P, N, x.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(),
        img.defined() ? img.data_ptr<scalar_t>() : nullptr,
        C.defined() ? C.data_ptr<scalar_t>() : nullptr, diff.data_ptr<scalar_t>(),
        dist.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {diff, dist};
}

at::Tensor pair_vectors_backward_cuda(const at::Tensor& grad, const at::Tensor& pairs,
                                      int64_t num_atoms) {
  const char* op = "torchani_fast::pair_vectors_backward";
  TORCH_CHECK(num_atoms >= 0, op, ": num_atoms must be >= 0, got ", num_atoms);
  const at::Device device = grad.device();
  check_pairs(op, pairs, device);
  const int64_t P = pairs.size(1), N = num_atoms;
  TORCH_CHECK(at::isFloatingType(grad.scalar_type()) && grad.sizes() == at::IntArrayRef({P, 3}),
              op, ": grad must be a float (", P, ", 3) tensor, got ", grad.scalar_type(), " ",
              grad.sizes());
  c10::cuda::CUDAGuard guard(device);
  if (P == 0) return at::zeros({N, 3}, grad.options());
  at::Tensor out = at::empty({N, 3}, grad.options());
  const at::Tensor g = grad.contiguous(), idx = pairs.contiguous();
  at::Tensor count = at::zeros({N + 1}, idx.options());
  at::Tensor edges = at::empty({N * kEdges}, idx.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "pair_vectors_backward_cuda", [&] {
    edge_kernel<scalar_t><<<cuda::grid_for(P, kThreads), kThreads, 0, stream>>>(
        P, N, idx.data_ptr<int64_t>(), g.data_ptr<scalar_t>(), count.data_ptr<int64_t>(),
        edges.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (N > 0) {
      gather_kernel<scalar_t><<<cuda::grid_for(N, kThreads), kThreads, 0, stream>>>(
          P, N, idx.data_ptr<int64_t>(), g.data_ptr<scalar_t>(), count.data_ptr<int64_t>(),
          edges.data_ptr<int64_t>(), out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

}  // namespace torchani_fast
