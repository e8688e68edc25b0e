// The networks in ATen ops, on any device: the activations with their first
// and second derivatives as PyTorch's modules and autograd compute them, the
// first layer of all members at once, and the input gradient of a group's
// networks. Shared by autograd.cpp (the recomputation behind ensemble_atomic's
// backward) and ensemble/train.cpp (ensemble_train).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>

#include <vector>

namespace torchani_fast {
namespace aten_mlp {

// PyTorch's CELU backward scales by 1 / float32(alpha) even in float64
// (torchani_fast/nn/recompute.py, _CELU_INPUT_SCALE): the same kernel here.
constexpr double kCeluAlpha = 0.1;
inline double celu_input_scale() { return 1.0 / static_cast<double>(static_cast<float>(kCeluAlpha)); }
constexpr int64_t kActivationGelu = 1;  // the ops' `activation`: 0 CELU(0.1), 1 GELU (exact erf)

inline at::Tensor activation_forward(const at::Tensor& h, int64_t activation) {
  return activation == kActivationGelu ? at::gelu(h) : at::celu(h, kCeluAlpha);
}

// grad * sigma'(pre): differentiable (elu_backward / gelu_backward).
inline at::Tensor activation_backward(const at::Tensor& grad, const at::Tensor& pre,
                                      int64_t activation) {
  if (activation == kActivationGelu) return at::gelu_backward(grad, pre);
  return at::elu_backward(grad, kCeluAlpha, 1.0, celu_input_scale(), false, pre);
}

// grad * sigma''(pre), as PyTorch's double backward of the activation computes
// it: CELU c^2 alpha exp(c pre) below 0 (c = 1/float32(alpha)), 0 above;
// GELU phi(pre) (2 - pre^2) with phi the normal density.
inline at::Tensor activation_second(const at::Tensor& grad, const at::Tensor& pre,
                                    int64_t activation) {
  if (activation == kActivationGelu) {
    const double inv_sqrt_2pi = 0.3989422804014327;
    const at::Tensor sq = pre * pre;
    return grad * (at::exp(sq * -0.5) * inv_sqrt_2pi) * (2.0 - sq);
  }
  const double c = celu_input_scale();
  return at::where(pre.le(0), grad * (c * c * kCeluAlpha) * at::exp(pre * c),
                   at::zeros({}, grad.options()));
}

// sigma''(pre) * tangent * above, given tangent_out = sigma'(pre) * tangent
// (activation_backward(tangent, pre)): for CELU sigma'' = c sigma' below 0 and
// 0 above, which saves the exponential.
// On the CPU CELU's is one pass (TensorIterator) instead of four ATen ops.
inline at::Tensor activation_second_along(const at::Tensor& above, const at::Tensor& tangent,
                                          const at::Tensor& tangent_out, const at::Tensor& pre,
                                          int64_t activation) {
  if (activation == kActivationGelu) return activation_second(above * tangent, pre, activation);
  if (!above.is_cpu())
    return (tangent_out * above).mul_(celu_input_scale()).masked_fill_(pre.gt(0), 0);
  at::Tensor out;  // allocated by the iterator, in the inputs' memory order
  auto iter = at::TensorIteratorConfig()
                  .add_output(out)
                  .add_const_input(tangent_out)
                  .add_const_input(above)
                  .add_const_input(pre)
                  .build();
  AT_DISPATCH_FLOATING_TYPES(above.scalar_type(), "celu_second_along", [&] {
    const scalar_t c = static_cast<scalar_t>(celu_input_scale());
    iter.for_each([c](char** data, const int64_t* strides, int64_t n) {
      constexpr int64_t size = sizeof(scalar_t);
      if (strides[0] == size && strides[1] == size && strides[2] == size && strides[3] == size) {
        scalar_t* out = reinterpret_cast<scalar_t*>(data[0]);
        const scalar_t* t = reinterpret_cast<const scalar_t*>(data[1]);
        const scalar_t* a = reinterpret_cast<const scalar_t*>(data[2]);
        const scalar_t* p = reinterpret_cast<const scalar_t*>(data[3]);
        for (int64_t i = 0; i < n; ++i) out[i] = p[i] > 0 ? scalar_t(0) : t[i] * a[i] * c;
        return;
      }
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t t = *reinterpret_cast<const scalar_t*>(data[1] + i * strides[1]);
        const scalar_t a = *reinterpret_cast<const scalar_t*>(data[2] + i * strides[2]);
        const scalar_t p = *reinterpret_cast<const scalar_t*>(data[3] + i * strides[3]);
        *reinterpret_cast<scalar_t*>(data[0] + i * strides[0]) = p > 0 ? scalar_t(0) : t * a * c;
      }
    });
  });
  return iter.output();
}

// Layer 1 of all `members`, (members, n, d1), from x (n, K), w1 (K, members*d1),
// b1 (members*d1,): one product; small groups (n <= small) as a batched product,
// as torchani_fast/nn/recompute.py (_first_layer) evaluates it.
inline at::Tensor first_layer(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                              int64_t members, int64_t small) {
  const int64_t n = x.size(0), in_dim = x.size(1);
  if (n <= small) {
    return at::baddbmm(b1.view({members, 1, -1}), x.unsqueeze(0).expand({members, n, in_dim}),
                       w1.view({in_dim, members, -1}).transpose(0, 1));
  }
  return at::addmm(b1, x, w1).view({n, members, -1}).transpose(0, 1);
}

// d(sum grad * outputs)/dx (n, K) of one group's networks at x (n, K), all
// members (grad: (members, n)); `packs` = b1, W2, b2, ... (nn/training.py);
// differentiable ATen ops throughout.
inline at::Tensor input_grad(const at::Tensor& x, const at::Tensor& grad, const at::Tensor& w1,
                             const std::vector<at::Tensor>& packs, int64_t members,
                             int64_t activation) {
  const int64_t n = x.size(0), layers = (static_cast<int64_t>(packs.size()) + 1) / 2;
  at::Tensor h = at::addmm(packs[0], x, w1).view({n, members, -1}).transpose(0, 1);
  std::vector<at::Tensor> pre;
  for (int64_t l = 1; l < layers; ++l) {
    pre.push_back(h);
    h = at::baddbmm(packs[2 * l], activation_forward(h, activation), packs[2 * l - 1]);
  }
  at::Tensor g = grad.unsqueeze(2);  // (members, n, 1)
  for (int64_t l = layers - 1; l >= 1; --l) {
    g = activation_backward(at::bmm(g, packs[2 * l - 1].transpose(1, 2)), pre[l - 1], activation);
  }
  return g.transpose(0, 1).reshape({n, -1}).mm(w1.t());
}

}  // namespace aten_mlp
}  // namespace torchani_fast
