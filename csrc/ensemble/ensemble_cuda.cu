// The fused ensemble networks on CUDA: ensemble_dense (ops.h).
//
// Every element's network of every member, for all atoms, in two or three
// launches whatever the composition, with nothing read back to the host:
//
//   group_kernel   one block: a stable counting sort of the atoms by element
//                  (order, and the first position of each element, on the
//                  device), and the outputs of padding atoms (0) and of atoms
//                  with an element outside [-1, S) (NaN)
//   mlp_kernel     one block per (tile of up to TA atoms of one element,
//                  slice of the members): all the layers of each member of the
//                  slice, the activations of the tile in shared memory, then
//                  back through the layers for d(output)/d(aev) of the tile
//   sum_kernel     with one slice per member (small inputs, so that the GPU
//                  has blocks enough): the slices' partial sums, in member order
//
// The grid covers the largest number of tiles any composition can have
// (ceil(N / TA) + S); the blocks past the composition's tiles return at once.
// Each output element is written by one thread, which adds the members in
// member order (in registers, or through sum_kernel: the same order, so the
// same bits either way): no atomics, the same bits on every run.
//
// Weights are stacked per layer over (element, member) and zero-padded to the
// widest element: a padded unit has pre-activation 0, activation 0 (CELU and
// GELU vanish at 0) and zero outgoing weights, so it changes no value.
// Layer l (d_in -> d_out): thread j owns outputs j, j + blockDim, ... for all
// TA atoms of the tile, reading W[i][j] (row-major (d_in, d_out): coalesced);
// the backward reads W^T (d_out, d_in) the same way.
#include "common/cuda_common.cuh"
#include "ops.h"

#include <algorithm>

namespace torchani_fast {
namespace {

constexpr int kMaxLayers = 8;
constexpr int kMaxSpecies = 32;
constexpr int kGroupThreads = 256;
constexpr int kThreads = 128;
constexpr int kSumThreads = 256;
// Tiles (ceil(N / TA)) below which each member gets blocks of its own (the
// split). The CUDA emulator's build lowers it, so that its small inputs take
// both paths (tests/cuda_emulation/build.py).
#ifndef TORCHANI_FAST_DENSE_SPLIT_TILES
#define TORCHANI_FAST_DENSE_SPLIT_TILES 128
#endif
constexpr int64_t kSplitTiles = TORCHANI_FAST_DENSE_SPLIT_TILES;

template <typename T>
struct Tile;  // atoms per tile: 8 in float32, 4 in float64 (the same shared memory)
template <>
struct Tile<float> {
  static constexpr int kAtoms = 8;
};
template <>
struct Tile<double> {
  static constexpr int kAtoms = 4;
};

template <typename T>
struct Net {
  const T* w[kMaxLayers];   // (S, k, d_in, d_out)
  const T* wt[kMaxLayers];  // (S, k, d_out, d_in)
  const T* b[kMaxLayers];   // (S, k, d_out)
  int din[kMaxLayers];
  int dout[kMaxLayers];
  int deriv_off[kMaxLayers];  // hidden layer l's derivatives: offset in the tile's rows
  int layers;
  int members;
  int species;
  int width;        // widest hidden layer
  int hidden_sum;   // sum of the hidden widths
  int activation;   // 0 CELU(0.1), 1 GELU
};

// CELU(0.1) and GELU with their derivatives. float64 as PyTorch computes them
// (CELU's backward scales by 1 / float32(alpha), recompute.py), float32 in float.
__device__ __forceinline__ float act_expm1(float x) { return expm1f(x); }
__device__ __forceinline__ double act_expm1(double x) { return expm1(x); }
__device__ __forceinline__ float act_erf(float x) { return erff(x); }
__device__ __forceinline__ double act_erf(double x) { return erf(x); }

template <typename T>
__device__ __forceinline__ T activate(int activation, T x, T& deriv) {
  if (activation == 1) {
    const T sqrt1_2 = T(0.70710678118654752440);
    const T beta = T(0.39894228040143267794);  // 1 / sqrt(2 pi)
    const T cdf = T(0.5) * (T(1) + act_erf(x * sqrt1_2));
    deriv = cdf + x * beta * cuda::dexp(x * x * T(-0.5));
    return x * cdf;
  }
  if (!(x <= T(0))) {
    deriv = T(1);
    return x;
  }
  const T c = T(1) / static_cast<T>(0.1f);
  deriv = c * T(0.1) * cuda::dexp(x * c);
  return T(0.1) * act_expm1(x * T(10));
}

// ---------------------------------------------------------------------------
// Grouping: order (N) holds the atoms of element 0, then 1, ... (each in
// increasing index); first (S + 1) where each element starts (first[S]: the
// atoms with an element).

template <typename T>
__global__ void group_kernel(const int64_t* __restrict__ elem, int64_t N, int S,
                             int64_t* __restrict__ order, int64_t* __restrict__ first,
                             T* __restrict__ atomic, T* __restrict__ jac, int64_t F) {
  __shared__ int counts[kMaxSpecies * kGroupThreads];  // [e][t] (N < 2^31)
  __shared__ int partial[kGroupThreads];
  const int t = threadIdx.x, nt = blockDim.x;
  const int64_t chunk = (N + nt - 1) / nt;
  const int64_t lo = cuda::imin(N, t * chunk), hi = cuda::imin(N, lo + chunk);
  for (int e = 0; e < S; ++e) counts[e * nt + t] = 0;
  for (int64_t n = lo; n < hi; ++n) {
    const int64_t e = elem[n];
    if (e >= 0 && e < S) counts[e * nt + t] += 1;
  }
  __syncthreads();
  // Exclusive scan of counts in [e][t] order: thread t scans entries
  // [t S, (t + 1) S), thread 0 the threads' totals.
  int sum = 0;
  for (int i = t * S; i < (t + 1) * S; ++i) sum += counts[i];
  partial[t] = sum;
  __syncthreads();
  if (t == 0) {
    int run = 0;
    for (int i = 0; i < nt; ++i) {
      const int v = partial[i];
      partial[i] = run;
      run += v;
    }
    first[S] = run;
  }
  __syncthreads();
  int run = partial[t];
  for (int i = t * S; i < (t + 1) * S; ++i) {
    const int v = counts[i];
    counts[i] = run;
    run += v;
  }
  __syncthreads();
  if (t < S) first[t] = counts[t * nt];
  __syncthreads();  // (before counts[e][0] moves on below)
  for (int64_t n = lo; n < hi; ++n) {
    const int64_t e = elem[n];
    if (e >= 0 && e < S) {
      order[counts[e * nt + t]++] = n;
    } else {
      const T v = e == -1 ? T(0) : T(NAN);
      atomic[n] = v;
      if (jac != nullptr) {
        for (int64_t f = 0; f < F; ++f) jac[n * F + f] = v;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// The networks of one tile of atoms, members [m0, m1).
//
// Shared memory (TA rows each): two activation buffers of `width` (ping-pong;
// the backward reuses them for the gradients), the hidden layers' derivatives
// (hidden_sum), and the tile's outputs summed over the members.
//
// atomic_out / jac_out: the final outputs (N,), (N, F) when the block owns all
// the members (m0 = 0, m1 = k), else the slice's partial sums, slice-major.

template <typename T>
__global__ void mlp_kernel(const T* __restrict__ aev, int64_t N, int64_t F, Net<T> net,
                           const int64_t* __restrict__ order, const int64_t* __restrict__ first,
                           int64_t tiles_cap, int members_per_slice, T* __restrict__ atomic_out,
                           T* __restrict__ jac_out) {
  constexpr int TA = Tile<T>::kAtoms;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* buf0 = reinterpret_cast<T*>(smem_raw);
  T* buf1 = buf0 + TA * net.width;
  T* derivs = buf1 + TA * net.width;
  T* outsum = derivs + TA * net.hidden_sum;

  const int64_t tile = static_cast<int64_t>(blockIdx.x) % tiles_cap;
  const int slice = static_cast<int>(static_cast<int64_t>(blockIdx.x) / tiles_cap);
  // This tile's element and first atom (in order).
  int elem = -1;
  int64_t start = 0, count = 0, seen = 0;
  for (int e = 0; e < net.species; ++e) {
    const int64_t n_e = first[e + 1] - first[e];
    const int64_t tiles_e = (n_e + TA - 1) / TA;
    if (tile < seen + tiles_e) {
      elem = e;
      start = first[e] + (tile - seen) * TA;
      count = cuda::imin(TA, first[e + 1] - start);
      break;
    }
    seen += tiles_e;
  }
  if (elem < 0) return;  // past the composition's tiles (the whole block)
  int64_t atom[TA];
#pragma unroll
  for (int a = 0; a < TA; ++a) atom[a] = order[start + (a < count ? a : count - 1)];

  const int t = threadIdx.x, nt = blockDim.x;
  const int L = net.layers;
  const int m0 = slice * members_per_slice;
  const int m1 = m0 + members_per_slice < net.members ? m0 + members_per_slice : net.members;
  const bool partial = members_per_slice < net.members;
  T* jac = jac_out == nullptr ? nullptr : jac_out + (partial ? slice * N * F : 0);
  T* atomic = atomic_out + (partial ? slice * N : 0);
  if (t < TA) outsum[t] = T(0);

  for (int m = m0; m < m1; ++m) {
    const int64_t em = static_cast<int64_t>(elem) * net.members + m;
    // Forward through the hidden layers: input (global aev, then the buffers).
    const T* in = nullptr;
    T* out = buf0;
    for (int l = 0; l < L - 1; ++l) {
      const int din = net.din[l], dout = net.dout[l];
      const T* W = net.w[l] + em * din * dout;
      const T* B = net.b[l] + em * dout;
      T* D = derivs + TA * net.deriv_off[l];
      for (int j = t; j < dout; j += nt) {
        T acc[TA];
#pragma unroll
        for (int a = 0; a < TA; ++a) acc[a] = B[j];
        if (l == 0) {
          for (int i = 0; i < din; ++i) {
            const T w = W[static_cast<int64_t>(i) * dout + j];
#pragma unroll
            for (int a = 0; a < TA; ++a) acc[a] += aev[atom[a] * F + i] * w;
          }
        } else {
          for (int i = 0; i < din; ++i) {
            const T w = W[static_cast<int64_t>(i) * dout + j];
#pragma unroll
            for (int a = 0; a < TA; ++a) acc[a] += in[a * net.width + i] * w;
          }
        }
#pragma unroll
        for (int a = 0; a < TA; ++a) {
          T d;
          out[a * net.width + j] = activate(net.activation, acc[a], d);
          D[a * dout + j] = d;
        }
      }
      __syncthreads();
      in = out;
      out = out == buf0 ? buf1 : buf0;
    }
    // The last layer (one output): a serial dot product per atom.
    {
      const int din = net.din[L - 1];
      const T* W = net.w[L - 1] + em * din;
      const T bias = net.b[L - 1][em];
      if (t < TA) {
        T acc = bias;
        for (int i = 0; i < din; ++i) acc += in[t * net.width + i] * W[i];
        outsum[t] += acc;
      }
    }
    if (jac == nullptr) {
      __syncthreads();  // (in is overwritten by the next member)
      continue;
    }
    // Backward: g = d(output)/d(pre-activation of hidden layer l), from the top.
    T* g = out;  // the buffer not holding the last hidden activations
    {
      const int l = L - 2;
      const int d = net.dout[l];
      const T* W = net.w[L - 1] + em * d;
      const T* D = derivs + TA * net.deriv_off[l];
      for (int i = t; i < d; i += nt) {
        const T w = W[i];
#pragma unroll
        for (int a = 0; a < TA; ++a) g[a * net.width + i] = D[a * d + i] * w;
      }
    }
    __syncthreads();
    for (int l = L - 2; l >= 1; --l) {
      // gin (pre-activation of layer l - 1) = D_{l-1} * (W_l g).
      const int din = net.din[l], dout = net.dout[l];
      const T* WT = net.wt[l] + em * din * dout;
      const T* D = derivs + TA * net.deriv_off[l - 1];
      T* gin = g == buf0 ? buf1 : buf0;
      for (int i = t; i < din; i += nt) {
        T acc[TA];
#pragma unroll
        for (int a = 0; a < TA; ++a) acc[a] = T(0);
        for (int j = 0; j < dout; ++j) {
          const T w = WT[static_cast<int64_t>(j) * din + i];
#pragma unroll
          for (int a = 0; a < TA; ++a) acc[a] += g[a * net.width + j] * w;
        }
#pragma unroll
        for (int a = 0; a < TA; ++a) gin[a * net.width + i] = D[a * din + i] * acc[a];
      }
      __syncthreads();
      g = gin;
    }
    {
      // d(output)/d(aev) = W_1 g, added to the members before (same thread).
      const int dout = net.dout[0];
      const T* WT = net.wt[0] + em * F * dout;
      for (int64_t f = t; f < F; f += nt) {
        T acc[TA];
#pragma unroll
        for (int a = 0; a < TA; ++a) acc[a] = T(0);
        for (int j = 0; j < dout; ++j) {
          const T w = WT[static_cast<int64_t>(j) * F + f];
#pragma unroll
          for (int a = 0; a < TA; ++a) acc[a] += g[a * net.width + j] * w;
        }
#pragma unroll
        for (int a = 0; a < TA; ++a) {
          if (a < count) {
            T* dst = jac + atom[a] * F + f;
            *dst = m == m0 ? acc[a] : *dst + acc[a];
          }
        }
      }
    }
    __syncthreads();
  }
  if (t < count) atomic[atom[t]] = outsum[t];
}

// The slices' partial sums (slices, N) and (slices, N, F), added in slice
// (= member) order, for the atoms with an element (the others were written by
// group_kernel).
template <typename T>
__global__ void sum_kernel(const int64_t* __restrict__ elem, int64_t N, int64_t F, int S,
                           int slices, const T* __restrict__ atomic_part,
                           const T* __restrict__ jac_part, T* __restrict__ atomic,
                           T* __restrict__ jac) {
  const int64_t per_atom = 1 + (jac != nullptr ? F : 0);
  const int64_t total = N * per_atom;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / per_atom, c = i % per_atom;
    const int64_t e = elem[n];
    if (e < 0 || e >= S) continue;
    T acc = T(0);
    if (c == 0) {
      for (int s = 0; s < slices; ++s) acc = s == 0 ? atomic_part[n] : acc + atomic_part[s * N + n];
      atomic[n] = acc;
    } else {
      const int64_t off = n * F + (c - 1);
      for (int s = 0; s < slices; ++s) acc = s == 0 ? jac_part[off] : acc + jac_part[s * N * F + off];
      jac[off] = acc;
    }
  }
}

void check_args(const at::Tensor& aev, const at::Tensor& elem_idxs, at::TensorList weights,
                at::TensorList weights_t, at::TensorList biases, int64_t activation) {
  constexpr const char* op = "torchani_fast::ensemble_dense";
  TORCH_CHECK(aev.dim() == 2, op, ": aev must be (atoms, features), got shape ", aev.sizes());
  TORCH_CHECK(aev.scalar_type() == at::kFloat || aev.scalar_type() == at::kDouble, op,
              ": aev must be float32 or float64, got ", aev.scalar_type());
  TORCH_CHECK(elem_idxs.dim() == 1 && elem_idxs.size(0) == aev.size(0), op,
              ": elem_idxs must be (atoms,) = (", aev.size(0), ",), got shape ", elem_idxs.sizes());
  TORCH_CHECK(elem_idxs.scalar_type() == at::kLong, op, ": elem_idxs must be int64, got ",
              elem_idxs.scalar_type());
  const int64_t L = static_cast<int64_t>(weights.size());
  TORCH_CHECK(L >= 2 && L <= kMaxLayers, op, ": weights must hold 2 to ", kMaxLayers,
              " layers, got ", L);
  TORCH_CHECK(static_cast<int64_t>(weights_t.size()) == L &&
                  static_cast<int64_t>(biases.size()) == L,
              op, ": weights, weights_t and biases must have one entry per layer, got ", L, ", ",
              weights_t.size(), " and ", biases.size());
  TORCH_CHECK(activation == 0 || activation == 1, op,
              ": activation must be 0 (CELU(0.1)) or 1 (GELU), got ", activation);
  const int64_t S = weights[0].dim() == 4 ? weights[0].size(0) : -1;
  const int64_t k = weights[0].dim() == 4 ? weights[0].size(1) : -1;
  TORCH_CHECK(S >= 1 && S <= kMaxSpecies && k >= 1, op,
              ": weights[0] must be (species <= ", kMaxSpecies,
              ", members, features, width), got shape ", weights[0].sizes());
  int64_t din = aev.size(1);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& w = weights[l];
    TORCH_CHECK(w.dim() == 4 && w.size(0) == S && w.size(1) == k && w.size(2) == din, op,
                ": weights[", l, "] must be (", S, ", ", k, ", ", din, ", width), got shape ",
                w.sizes());
    const int64_t dout = w.size(3);
    TORCH_CHECK(l + 1 < L || dout == 1, op, ": the last layer must have one output, got ", dout);
    TORCH_CHECK(weights_t[l].sizes() == at::IntArrayRef({S, k, dout, din}), op, ": weights_t[", l,
                "] must be (", S, ", ", k, ", ", dout, ", ", din, "), got shape ",
                weights_t[l].sizes());
    TORCH_CHECK(biases[l].sizes() == at::IntArrayRef({S, k, dout}), op, ": biases[", l,
                "] must be (", S, ", ", k, ", ", dout, "), got shape ", biases[l].sizes());
    for (const at::Tensor* p : {&w, &weights_t[l], &biases[l]}) {
      TORCH_CHECK(p->scalar_type() == aev.scalar_type(), op, ": weights of layer ", l,
                  " must have aev's dtype ", aev.scalar_type(), ", got ", p->scalar_type());
      TORCH_CHECK(p->is_contiguous(), op, ": weights of layer ", l, " must be contiguous");
      cuda::check_same_device(op, "weights", *p, aev.device());
    }
    din = dout;
  }
  cuda::check_same_device(op, "elem_idxs", elem_idxs, aev.device());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ensemble_dense_cuda(
    const at::Tensor& aev_in, const at::Tensor& elem_in, at::TensorList weights,
    at::TensorList weights_t, at::TensorList biases, int64_t activation, bool input_grad) {
  check_args(aev_in, elem_in, weights, weights_t, biases, activation);
  TORCH_CHECK(aev_in.size(0) < (int64_t(1) << 31), "torchani_fast::ensemble_dense: at most 2^31 - 1 atoms, got ",
              aev_in.size(0));
  c10::cuda::CUDAGuard guard(aev_in.device());
  const at::Tensor aev = aev_in.contiguous();
  const at::Tensor elem = elem_in.contiguous();
  const int64_t N = aev.size(0), F = aev.size(1);
  const int L = static_cast<int>(weights.size());
  const int S = static_cast<int>(weights[0].size(0));
  const int k = static_cast<int>(weights[0].size(1));
  at::Tensor atomic = at::empty({N}, aev.options());
  at::Tensor jac = at::empty({input_grad ? N : 0, F}, aev.options());
  if (N == 0) return {atomic, jac};
  at::Tensor order = at::empty({N}, elem.options());
  at::Tensor first = at::empty({S + 1}, elem.options());
  auto stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES(aev.scalar_type(), "ensemble_dense_cuda", [&] {
    using T = scalar_t;
    constexpr int TA = Tile<T>::kAtoms;
    Net<T> net{};
    net.layers = L;
    net.members = k;
    net.species = S;
    net.activation = static_cast<int>(activation);
    int off = 0;
    for (int l = 0; l < L; ++l) {
      net.w[l] = weights[l].data_ptr<T>();
      net.wt[l] = weights_t[l].data_ptr<T>();
      net.b[l] = biases[l].data_ptr<T>();
      net.din[l] = static_cast<int>(weights[l].size(2));
      net.dout[l] = static_cast<int>(weights[l].size(3));
      if (l + 1 < L) {
        net.deriv_off[l] = off;
        off += net.dout[l];
        net.width = std::max(net.width, net.dout[l]);
      }
    }
    net.hidden_sum = off;
    const size_t smem = static_cast<size_t>(TA) * (2 * net.width + net.hidden_sum + 1) * sizeof(T);
    const size_t optin = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
    TORCH_CHECK(smem <= optin, "torchani_fast::ensemble_dense: networks this wide need ", smem,
                " bytes of shared memory per block, more than the device's ", optin);
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(mlp_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    T* jac_ptr = input_grad ? jac.data_ptr<T>() : nullptr;
    group_kernel<T><<<1, kGroupThreads, 0, stream>>>(elem.data_ptr<int64_t>(), N, S,
                                                     order.data_ptr<int64_t>(),
                                                     first.data_ptr<int64_t>(), atomic.data_ptr<T>(),
                                                     jac_ptr, F);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // Any composition has at most ceil(N / TA) + S tiles. Few tiles: a block
    // per (tile, member), the members summed by sum_kernel in member order
    // (the same bits as one block adding them).
    const int64_t tiles_cap = cuda::ceil_div(N, TA) + S;
    const bool split = k > 1 && cuda::ceil_div(N, TA) < kSplitTiles;
    const int slices = split ? k : 1;
    at::Tensor atomic_part, jac_part;
    T* atomic_dst = atomic.data_ptr<T>();
    T* jac_dst = jac_ptr;
    if (split) {
      atomic_part = at::empty({slices, N}, aev.options());
      atomic_dst = atomic_part.data_ptr<T>();
      if (input_grad) {
        jac_part = at::empty({slices, N, F}, aev.options());
        jac_dst = jac_part.data_ptr<T>();
      }
    }
    mlp_kernel<T><<<static_cast<unsigned int>(tiles_cap * slices), kThreads, smem, stream>>>(
        aev.data_ptr<T>(), N, F, net, order.data_ptr<int64_t>(), first.data_ptr<int64_t>(),
        tiles_cap, split ? 1 : k, atomic_dst, jac_dst);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (split) {
      const int64_t items = N * (1 + (input_grad ? F : 0));
      sum_kernel<T><<<cuda::grid_for(items, kSumThreads), kSumThreads, 0, stream>>>(
          elem.data_ptr<int64_t>(), N, F, S, slices, atomic_part.data_ptr<T>(),
          input_grad ? jac_part.data_ptr<T>() : nullptr, atomic.data_ptr<T>(), jac_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {atomic, jac};
}

}  // namespace torchani_fast
