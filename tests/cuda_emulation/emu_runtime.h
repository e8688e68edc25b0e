// A tiny CUDA emulator for testing the kernels of csrc/**/*.cu without a GPU.
//
// build.py copies each .cu file, rewrites its kernel launches into
// emu::launch(...) and its dynamic shared memory into a pointer, and compiles
// it as host C++ with this file standing in for csrc/common/cuda_common.cuh. Every
// CUDA thread becomes an OS thread; blocks run one after another, so
// `__shared__` variables become function statics. __syncthreads, __syncwarp
// and warp shuffles are real barriers, which is stricter than the hardware:
// lanes never run in lockstep here, so a missing __syncwarp or a shuffle that
// only part of a warp reaches shows up as a wrong result or a deadlock.
//
// Only for tests: slow (thousands of threads per launch), small inputs only.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct emu_dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

namespace emu {

struct Block {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<double> exchange;  // one slot per thread, for shuffles
  std::vector<unsigned char> smem;
};

inline thread_local emu_dim3 tl_thread, tl_block_idx, tl_block_dim, tl_grid_dim;
inline thread_local Block* tl_state = nullptr;

inline unsigned char* dynamic_smem() {
  return reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(tl_state->smem.data()) + 15) & ~uintptr_t(15));
}

// Kernel launches so far (torch.ops.torchani_fast_emu.launch_count()).
inline std::atomic<int64_t> launches{0};

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), unsigned int grid, unsigned int block, size_t smem,
            int /*stream*/, Args&&... args) {
  TORCH_CHECK(block % 32 == 0 && block > 0 && block <= 1024, "emu: bad block size ", block);
  launches.fetch_add(1);
  for (unsigned int b = 0; b < grid; ++b) {
    Block st;
    st.all = std::make_unique<std::barrier<>>(block);
    for (unsigned int w = 0; w < block / 32; ++w)
      st.warps.push_back(std::make_unique<std::barrier<>>(32));
    st.exchange.assign(block, 0.0);
    st.smem.assign(smem + 16, 0xA5);  // garbage, as on the device
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned int t = 0; t < block; ++t)
      threads.emplace_back([&, t] {
        tl_thread.x = t;
        tl_block_idx.x = b;
        tl_block_dim.x = block;
        tl_grid_dim.x = grid;
        tl_state = &st;
        kernel(static_cast<KArgs>(args)...);
        st.warps[t / 32]->arrive_and_drop();
        st.all->arrive_and_drop();
      });
    for (auto& th : threads) th.join();
  }
}

}  // namespace emu

#define threadIdx (::emu::tl_thread)
#define blockIdx (::emu::tl_block_idx)
#define blockDim (::emu::tl_block_dim)
#define gridDim (::emu::tl_grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)

inline void __syncthreads() { emu::tl_state->all->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  emu::tl_state->warps[threadIdx.x / 32]->arrive_and_wait();
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int offset) {
  auto* st = emu::tl_state;
  const unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
  st->exchange[t] = static_cast<double>(v);  // exact for float and double
  st->warps[w]->arrive_and_wait();
  const T r = static_cast<T>(st->exchange[w * 32 + (lane ^ static_cast<unsigned>(offset))]);
  st->warps[w]->arrive_and_wait();
  return r;
}

// A ballot is a real barrier of the whole warp, like the shuffles: every lane
// must reach it (only full masks are emulated; a partial one is refused).
inline unsigned __ballot_sync(unsigned mask, int pred) {
  TORCH_CHECK(mask == 0xffffffffu, "emu: __ballot_sync with a partial mask ", mask);
  auto* st = emu::tl_state;
  const unsigned t = threadIdx.x, w = t / 32;
  st->exchange[t] = pred ? 1.0 : 0.0;
  st->warps[w]->arrive_and_wait();
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l)
    if (st->exchange[w * 32 + l] != 0.0) r |= 1u << l;
  st->warps[w]->arrive_and_wait();
  return r;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}
inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_or(v);
}
inline long long atomicMax(long long* p, long long v) {
  std::atomic_ref<long long> a(*p);
  long long old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
inline long long __double_as_longlong(double d) {
  long long r;
  std::memcpy(&r, &d, sizeof r);
  return r;
}
using std::isfinite;

// Host stand-ins for the CUDA runtime calls the entry points make.
enum { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <typename F>
int cudaFuncSetAttribute(F, int, int) {
  return 0;
}
#define C10_CUDA_CHECK(x) (void)(x)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() (void)0

namespace at {
namespace cuda {
struct EmuProps {
  int multiProcessorCount = 2;
  size_t sharedMemPerBlockOptin = 227 * 1024;
};
inline const EmuProps* getCurrentDeviceProperties() {
  static EmuProps p;
  return &p;
}
inline int getCurrentCUDAStream() { return 0; }
inline int current_device() { return 0; }
}  // namespace cuda
}  // namespace at
namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(const at::Device&) {}
};
}  // namespace cuda
}  // namespace c10

// The helpers of csrc/common/cuda_common.cuh, in host form.
namespace torchani_fast {
namespace cuda {

constexpr int kWarp = 32;

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Device& device) {
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device,
              " like the other inputs, got a tensor on ", t.device());
}
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = ceil_div(n > 0 ? n : 1, threads);
  const int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<unsigned int>(blocks < cap ? blocks : cap);
}
inline float dexp(float x) { return std::exp(x); }
inline double dexp(double x) { return std::exp(x); }
inline float dpow(float x, float y) { return std::pow(x, y); }
inline double dpow(double x, double y) { return std::pow(x, y); }
inline float dcos(float x) { return std::cos(x); }
inline double dcos(double x) { return std::cos(x); }
inline float dsin(float x) { return std::sin(x); }
inline double dsin(double x) { return std::sin(x); }
inline float dsqrt(float x) { return std::sqrt(x); }
inline double dsqrt(double x) { return std::sqrt(x); }
template <typename T>
T warp_sum(T v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t atomic_add_i64(int64_t* p, int64_t v) {
  return static_cast<int64_t>(
      atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v)));
}
inline void atomic_max_i64(int64_t* p, int64_t v) {
  atomicMax(reinterpret_cast<long long*>(p), static_cast<long long>(v));
}
inline void atomic_or_i64(int64_t* p, int64_t v) {
  atomicOr(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

}  // namespace cuda
}  // namespace torchani_fast
