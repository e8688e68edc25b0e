// The identity of an input tensor, for the AEV kernels that keep the forward's
// edges for the backward of the same call (aev_cpu.cpp, aev/cuda/aev_warp.cuh):
// the kept edges are read back only for the very tensors they were built from.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace torchani_fast {

// The same TensorImpl (referenced weakly, so that a new tensor at a freed one's
// address cannot match), version, data pointer, sizes and strides.
struct TensorId {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  int64_t version;
  const void* data;
  std::vector<int64_t> sizes, strides;

  explicit TensorId(const at::Tensor& t)
      : impl(t.getIntrusivePtr()), version(t._version()), data(t.data_ptr()),
        sizes(t.sizes().vec()), strides(t.strides().vec()) {}
  bool same(const at::Tensor& t) const {
    return impl._unsafe_get_target() == t.unsafeGetTensorImpl() && !t.is_inference() &&
           t._version() == version && t.data_ptr() == data && t.sizes().equals(sizes) &&
           t.strides().equals(strides);
  }
};

}  // namespace torchani_fast
