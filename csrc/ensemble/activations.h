// The networks' activations in place, with their derivatives, for the layers
// that the panel products do not activate themselves (ensemble/gemm.h applies
// them to its accumulators): CELU(0.1) and GELU in float32 (AVX2 through
// common/simd_math.h, else std::) and float64 (PyTorch's formulas), and erf
// (float32, for the tests' simd_erf). Included by ensemble_cpu.cpp and
// activations_cpu.cpp (the test ops).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/simd_math.h"
#include "ensemble/gemm.h"
#include "ensemble/gemm_f64.h"

namespace torchani_fast::ensemble_activations {

constexpr double kAlpha = 0.1;

// ---------------------------------------------------------------------------
// CELU(0.1) in place, with its derivative.
// ---------------------------------------------------------------------------

// float32: expm1 through simd::exp_parts (exp(u) = s (1 + q), so expm1(u) =
// (s - 1) + s q keeps its relative accuracy near 0); the scalar tail and CPUs
// without AVX2 use std::expm1 / std::exp.
inline void celu_scalar(float* z, float* d, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float x = z[i];
    if (!(x <= 0.0f)) {  // x > 0 or NaN: x passes through
      d[i] = 1.0f;
    } else {
      const float u = x * 10.0f;
      d[i] = std::exp(u);
      z[i] = static_cast<float>(kAlpha) * std::expm1(u);
    }
  }
}

#ifdef TF_SIMD_AVX2
TF_AVX2 inline void celu_avx2(float* z, float* d, int64_t count) {
  static_assert(kAlpha == 0.1, "simd::celu01 is CELU(0.1)");
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 deriv;
    _mm256_storeu_ps(z + i, simd::celu01(_mm256_loadu_ps(z + i), deriv));
    _mm256_storeu_ps(d + i, deriv);
  }
  celu_scalar(z + i, d + i, count - i);
}
#endif

// (Only the layers without panels take this pass: the panel products apply
// CELU to their accumulators, ensemble/gemm.h.)
inline void celu_inplace(float* z, float* d, int64_t count) {
#ifdef TF_SIMD_AVX2
  if (simd::have_avx2()) {
    celu_avx2(z, d, count);
    return;
  }
#endif
  celu_scalar(z, d, count);
}

inline void celu_inplace(double* z, double* d, int64_t count) {
  // PyTorch's CELU backward: alpha * c * exp(c x), c = 1 / float32(alpha).
  const double c = 1.0 / static_cast<double>(static_cast<float>(kAlpha));
  int64_t i = 0;
#ifdef TF_SIMD_AVX2
  static_assert(kAlpha == 0.1, "simd::celu01 is CELU(0.1)");
  if (simd::have_avx2()) i = small_gemm::celu_f64_avx2(z, d, count);
#endif
  for (; i < count; ++i) {
    const double x = z[i];
    if (!(x <= 0.0)) {
      d[i] = 1.0;
    } else {
      d[i] = c * kAlpha * std::exp(x * c);
      z[i] = kAlpha * std::expm1(x * (1.0 / kAlpha));
    }
  }
}

// GELU in place with its derivative. float64: PyTorch's GeluKernel /
// GeluBackwardKernel formulas (approximate="none"), as TorchANI's float64
// networks. The float32 scalar tail and CPUs without AVX2 evaluate in double,
// Phi as erfc(-x / sqrt 2) / 2 (1 + erf cancels below x = -8, where float32
// still has GELU(x)).
inline void gelu_scalar(float* z, float* d, int64_t count) {
  constexpr double kAlphaG = M_SQRT1_2, kBeta = M_2_SQRTPI * M_SQRT1_2 * 0.5;
  for (int64_t i = 0; i < count; ++i) {
    const double x = z[i];
    const double cdf = 0.5 * std::erfc(-x * kAlphaG);
    d[i] = static_cast<float>(cdf + x * kBeta * std::exp(x * x * -0.5));
    z[i] = static_cast<float>(x * cdf);
  }
}

inline void gelu_inplace(double* z, double* d, int64_t count) {
  for (int64_t i = 0; i < count; ++i) z[i] = small_gemm::gelu_f64(z[i], d[i]);
}

#ifdef TF_SIMD_AVX2
TF_AVX2 inline void gelu_avx2(float* z, float* d, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 deriv;
    _mm256_storeu_ps(z + i, simd::gelu(_mm256_loadu_ps(z + i), deriv));
    _mm256_storeu_ps(d + i, deriv);
  }
  gelu_scalar(z + i, d + i, count - i);
}
#endif

inline void gelu_inplace(float* z, float* d, int64_t count) {
#ifdef TF_SIMD_AVX2
  if (simd::have_avx2()) {
    gelu_avx2(z, d, count);
    return;
  }
#endif
  gelu_scalar(z, d, count);
}

#ifdef TF_SIMD_AVX2
// erf in place over the whole vectors of p[0 .. n); returns where the tail starts.
TF_AVX2 inline int64_t erf_avx2(float* p, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, simd::erf(_mm256_loadu_ps(p + i)));
  return i;
}

TF_AVX512 inline int64_t erf_avx512(float* p, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(p + i, simd::erf(_mm512_loadu_ps(p + i)));
  return i;
}
#endif

template <typename T>
inline void activation_inplace(int64_t act, T* z, T* d, int64_t count) {
  if (act == small_gemm::kGelu) {
    gelu_inplace(z, d, count);
  } else {
    celu_inplace(z, d, count);
  }
}

}  // namespace torchani_fast::ensemble_activations
