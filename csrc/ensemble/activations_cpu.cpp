// simd_activation and simd_erf: the networks' activation and erf kernels
// (ensemble/activations.h) elementwise, for the tests.
#include <ATen/ATen.h>

#include <cmath>
#include <type_traits>

#include "common/simd_math.h"
#include "ensemble/activations.h"
#include "ops.h"

namespace torchani_fast {

using namespace ensemble_activations;

std::tuple<at::Tensor, at::Tensor> simd_activation_cpu(const at::Tensor& x, int64_t activation) {
  TORCH_CHECK(activation == small_gemm::kCelu01 || activation == small_gemm::kGelu,
              "simd_activation: activation = ", activation, " must be 0 (CELU(0.1)) or 1 (GELU)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "simd_activation: x must be float32 or float64, got ", x.scalar_type());
  at::Tensor values = x.contiguous().clone();
  at::Tensor deriv = at::empty_like(values);
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "simd_activation", [&] {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);  // as in the kernels
    activation_inplace(activation, values.data_ptr<scalar_t>(), deriv.data_ptr<scalar_t>(),
                       values.numel());
  });
  return {values, deriv};
}

at::Tensor simd_erf_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "simd_erf: x must be float32, got ", x.scalar_type());
  at::Tensor out = x.contiguous().clone();
  float* p = out.data_ptr<float>();
  const int64_t n = out.numel();
  int64_t i = 0;
#ifdef TF_SIMD_AVX2
  if (simd::have_avx512()) {
    i = erf_avx512(p, n);
  } else if (simd::have_avx2()) {
    i = erf_avx2(p, n);
  }
#endif
  for (; i < n; ++i) p[i] = std::erf(p[i]);
  return out;
}

}  // namespace torchani_fast
