// Helpers shared by the CUDA kernels: argument checks, math overloads that pick
// the float or double intrinsic, warp reductions and 64-bit atomics.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace torchani_fast {
namespace cuda {

constexpr int kWarp = 32;

// Same-device check with a message that names the argument and both devices.
inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device,
              " like the other inputs, got a tensor on ", t.device());
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid size for a grid-stride loop over n items, capped so that huge inputs
// do not launch more blocks than the device can keep busy.
inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = ceil_div(n > 0 ? n : 1, threads);
  const int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<unsigned int>(blocks < cap ? blocks : cap);
}

__device__ __forceinline__ float dexp(float x) { return expf(x); }
__device__ __forceinline__ double dexp(double x) { return exp(x); }
__device__ __forceinline__ float dpow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double dpow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float dcos(float x) { return cosf(x); }
__device__ __forceinline__ double dcos(double x) { return cos(x); }
__device__ __forceinline__ float dsin(float x) { return sinf(x); }
__device__ __forceinline__ double dsin(double x) { return sin(x); }
__device__ __forceinline__ float dsqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dsqrt(double x) { return sqrt(x); }

// Butterfly sum: every lane ends with the total, and the order of the additions
// is fixed, so the result is the same bits on every run.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ int64_t atomic_add_i64(int64_t* p, int64_t v) {
  return static_cast<int64_t>(
      atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v)));
}
__device__ __forceinline__ void atomic_max_i64(int64_t* p, int64_t v) {
  atomicMax(reinterpret_cast<long long*>(p), static_cast<long long>(v));
}
__device__ __forceinline__ void atomic_or_i64(int64_t* p, int64_t v) {
  atomicOr(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

}  // namespace cuda
}  // namespace torchani_fast
