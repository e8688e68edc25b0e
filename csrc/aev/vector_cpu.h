// Entry points of the vectorised CPU AEV kernels (aev/vector_cpu.cpp: float32;
// aev/vector_f64_cpu.cpp: float64), called
// by aev/aev_cpu.cpp's forward and backward when the half edges carry vectors.
#pragma once

#include <cstdint>

#include "aev/half_edges.h"
#include "common/simd_math.h"

namespace torchani_fast {
namespace aev_cpu_detail {

#ifdef TF_SIMD_AVX2
// float32 on AVX2 CPUs for the AEV shapes of every ANI model (vector_cpu.cpp).
bool vector_path(const Consts<float>& k);

// Atoms [begin, end): their AEV rows (forward) or the gradients of their half
// edges (backward, added to grad_edge, which the caller zeroed). wide: the exp
// and log on 16 lanes (AVX-512), the same bits.
void forward_atoms_vector(int64_t begin, int64_t end, const int64_t* species, const HalfEdges& h,
                          const Consts<float>& k, float* aev, bool wide);
void backward_atoms_vector(int64_t begin, int64_t end, const int64_t* species,
                           const HalfEdges& h, const Consts<float>& k, const float* grad_aev,
                           float* grad_edge, bool wide);

// float64 on AVX2 CPUs for the same shapes (vector_f64_cpu.cpp); wide: 8
// lanes (AVX-512) instead of 4, the same bits.
bool vector_path(const Consts<double>& k);
void forward_atoms_vector(int64_t begin, int64_t end, const int64_t* species, const HalfEdges& h,
                          const Consts<double>& k, double* aev, bool wide);
void backward_atoms_vector(int64_t begin, int64_t end, const int64_t* species,
                           const HalfEdges& h, const Consts<double>& k, const double* grad_aev,
                           double* grad_edge, bool wide);
#endif

}  // namespace aev_cpu_detail
}  // namespace torchani_fast
