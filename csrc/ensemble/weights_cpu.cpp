// weights_state: whether any of the networks' parameters requires grad, and a
// hash of their storages, offsets and version counters, from which the fused
// networks tell that their packed copy of the weights is stale.
#include <ATen/ATen.h>

#include <cstdint>

#include "ops.h"

namespace torchani_fast {

std::tuple<bool, int64_t> weights_state(at::TensorList params) {
  bool requires_grad = false;
  uint64_t h = 1469598103934665603ull;  // FNV-1a over 64-bit words
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (const at::Tensor& p : params) {
    requires_grad |= p.requires_grad();
    const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
    mix(impl->has_storage() ? reinterpret_cast<uintptr_t>(impl->storage().data()) : 0);
    mix(static_cast<uint64_t>(impl->storage_offset()));
    // Inference tensors keep no version counter (and cannot change outside
    // inference mode).
    mix(p.is_inference() ? 0 : static_cast<uint64_t>(p._version()));
  }
  return {requires_grad, static_cast<int64_t>(h >> 1)};
}

}  // namespace torchani_fast
