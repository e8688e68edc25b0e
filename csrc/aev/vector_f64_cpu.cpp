// The vectorised CPU AEV kernels in float64 (AVX2: 4 lanes, AVX-512: 8): the
// entry points that aev/aev_cpu.cpp's dispatch calls. The kernels are written
// once (vector_f64_body.h) over the lane operations of vector_f64_lanes.h and
// included here once per width; vector_f64_common.h holds the scratch and the
// 4-lane sums that both widths share (so both give the same bits).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "aev/half_edges.h"
#include "aev/vector_cpu.h"
#include "common/simd_math.h"
#include "common/simd_math_f64.h"

namespace torchani_fast {
namespace aev_cpu_detail {

#ifdef TF_SIMD_AVX2
// (GCC 12's AVX-512 headers read `_mm512_undefined_*()` in some unmasked
// operations; the values are never used.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {
#include "aev/vector_f64_common.h"
#include "aev/vector_f64_lanes.h"

namespace x4 {
#define TF_F64_FN TF_AVX2
#define TF_F64_INLINE TF_AVX2_INLINE
#include "aev/vector_f64_body.h"
}  // namespace x4

namespace x8 {
#define TF_F64_FN TF_AVX512
#define TF_F64_INLINE TF_AVX512_INLINE
#include "aev/vector_f64_body.h"
}  // namespace x8
}  // namespace

// The float32 kernels' shapes (vector_cpu.cpp): R a multiple of 8, A <= 8, Z
// 1, 2, 4 or 8 (every ANI model).
bool vector_path(const Consts<double>& k) {
  return simd::have_avx2() && k.R % 8 == 0 && k.A <= kMaxShiftsF64 &&
         (k.Z == 1 || k.Z == 2 || k.Z == 4 || k.Z == 8);
}

void forward_atoms_vector(int64_t begin, int64_t end, const int64_t* species, const HalfEdges& h,
                          const Consts<double>& k, double* aev, bool wide) {
  if (wide)
    x8::forward_atoms(begin, end, species, h, k, aev);
  else
    x4::forward_atoms(begin, end, species, h, k, aev);
}

void backward_atoms_vector(int64_t begin, int64_t end, const int64_t* species,
                           const HalfEdges& h, const Consts<double>& k, const double* grad_aev,
                           double* grad_edge, bool wide) {
  if (wide)
    x8::backward_atoms(begin, end, species, h, k, grad_aev, grad_edge);
  else
    x4::backward_atoms(begin, end, species, h, k, grad_aev, grad_edge);
}
#pragma GCC diagnostic pop
#endif

}  // namespace aev_cpu_detail
}  // namespace torchani_fast
