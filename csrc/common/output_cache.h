// Op outputs whose memory is reused from one call to the next (CPU).
//
// glibc gives multi-megabyte blocks back to the system when they are freed, so
// a fresh output of that size costs a page fault per 4 KB page when the
// kernel first writes it. For 3 000 waters the AEV and its gradient (12 MB
// each) took about 6 000 faults per energy + forces call. An OutputCache keeps
// the storage of the last tensor it returned and hands it out again once
// nothing else references it (use count back to 1): a tensor the caller still
// holds, or that autograd saved, is never reused. At most one block per cache,
// of 1-256 MB, stays allocated between calls.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>

namespace torchani_fast {

class OutputCache {
 public:
  // An uninitialised contiguous tensor, like at::empty.
  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t nbytes =
        static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
    if (nbytes < kMinBytes || nbytes > kMaxBytes) return at::empty(sizes, options);
    if (storage_ && storage_.use_count() == 1 && storage_.device() == options.device() &&
        storage_.nbytes() >= nbytes && storage_.nbytes() <= 2 * nbytes) {
      return at::empty({0}, options).set_(storage_, 0, sizes);
    }
    at::Tensor fresh = at::empty(sizes, options);
    storage_ = fresh.storage();
    return fresh;
  }

 private:
  static constexpr size_t kMinBytes = size_t(1) << 20;
  static constexpr size_t kMaxBytes = size_t(256) << 20;
  c10::Storage storage_;
};

}  // namespace torchani_fast
