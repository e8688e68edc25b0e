// The vectorised CPU AEV kernels (float32, AVX2 and AVX-512): the entry points
// that aev/aev_cpu.cpp's dispatch calls. The pieces live in three headers that only
// this file includes: vector_common.h (scratch, shared helpers), vector_avx512.h
// (16-lane code), vector_avx2.h (8-lane code and the per-atom loops).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "aev/half_edges.h"
#include "aev/vector_cpu.h"
#include "common/simd_math.h"

namespace torchani_fast {
namespace aev_cpu_detail {

#ifdef TF_SIMD_AVX2
// (GCC 12's AVX-512 headers read `_mm256_undefined_*()` in the casts and
// extracts of the 16-lane code; the values are never used.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {
#include "aev/vector_common.h"
#include "aev/vector_avx512.h"
#include "aev/vector_avx2.h"
}  // namespace

// float32 on AVX2 CPUs when R is a multiple of 8, A <= 8 and Z is 1, 2, 4 or 8
// (every ANI model: ANI-1x A = 4, Z = 8; ANI-2x A = 8, Z = 4). Radial terms:
// 8 shifts per vector. Angular terms: 8 triples per vector. An atom's
// neighbours come sorted by species (stably: build_half_edges), so that the
// triples of one species pair, which all add to the same AEV block, can be
// listed together; each block's list is padded to whole vectors with triples
// that add zero.
// The forward then keeps one accumulator vector per term of the block, and the
// backward reads the block's gradient as broadcasts. Per atom, the work and its
// order are fixed by the input, so results do not depend on the thread count.
// With AVX-512 the exp and log run on 16 lanes (two vectors of 8 triples or
// neighbours; blocks padded to 16), each lane doing the 8-lane code's
// operations, and the forward's sums stay on 8 lanes in the same order: the
// same bits as AVX2 (*512 functions, chosen per call with simd::have_avx512()).
// There the exp and log of several shifts or sections run side by side
// (simd::exp_n, log_n): as independent chains, one after the other, they
// kept the core waiting on their latency (10-15% of the AEV's time).
bool vector_path(const Consts<float>& k) {
  return simd::have_avx2() && k.R % 8 == 0 && k.A <= 8 &&
         (k.Z == 1 || k.Z == 2 || k.Z == 4 || k.Z == 8);
}

void forward_atoms_vector(int64_t begin, int64_t end, const int64_t* species, const HalfEdges& h,
                          const Consts<float>& k, float* aev, bool wide) {
  forward_atoms_avx2(begin, end, species, h, k, aev, wide);
}

void backward_atoms_vector(int64_t begin, int64_t end, const int64_t* species,
                           const HalfEdges& h, const Consts<float>& k, const float* grad_aev,
                           float* grad_edge, bool wide) {
  backward_atoms_avx2(begin, end, species, h, k, grad_aev, grad_edge, wide);
}
#pragma GCC diagnostic pop
#endif

}  // namespace aev_cpu_detail
}  // namespace torchani_fast
