// Workspace (torch.classes.torchani_fast.Workspace; torchani_fast.Workspace in
// Python): memory for the CPU ops' large outputs, owned by a caller that
// evaluates the same system again and again (EnergyForcesStep, the ASE
// calculator) and reused from one of its calls to the next.
//
// Why: glibc gives blocks above 32 MB back to the system when they are freed,
// so a fresh output of that size costs a page fault per 4 KB page when the
// kernel first writes it (float64, 8 232 waters: 32 000 faults and 12% of an
// energy + forces call; docs/design.md). Smaller blocks glibc keeps by itself.
//
// How: the caller makes its workspace current in its thread around a call
// (`with workspace:`, enter()/exit(); they nest). The ops take their large
// outputs (the AEV, and the AEV gradient of the networks op) from the current
// workspace, one slot per kind: the slot keeps the storage of the last tensor
// it handed out and hands it out again once nothing else references it (use
// count back to 1), so a tensor the caller holds, or that autograd saved, is
// never overwritten. Without a current workspace the ops allocate (at::empty)
// and keep nothing between calls. The memory is freed with the Workspace.
// The CPU autograd engine runs a backward in the thread that called it, so
// `with workspace: energy.backward()` reaches the backward's ops too.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstddef>
#include <cstdint>
#include <mutex>

namespace torchani_fast {

class OutputCache {
 public:
  // An uninitialised contiguous tensor, like at::empty.
  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t nbytes =
        static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
    if (nbytes < kMinBytes || nbytes > kMaxBytes) return at::empty(sizes, options);
    std::lock_guard<std::mutex> lock(mutex_);
    if (storage_ && storage_.use_count() == 1 && storage_.device() == options.device() &&
        storage_.nbytes() >= nbytes && storage_.nbytes() <= 2 * nbytes) {
      return at::empty({0}, options).set_(storage_, 0, sizes);
    }
    at::Tensor fresh = at::empty(sizes, options);
    storage_ = fresh.storage();
    return fresh;
  }

  int64_t nbytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return storage_ ? static_cast<int64_t>(storage_.nbytes()) : 0;
  }

  static constexpr size_t kMinBytes = size_t(1) << 20;

 private:
  static constexpr size_t kMaxBytes = size_t(256) << 20;
  std::mutex mutex_;
  c10::Storage storage_;
};

struct Workspace : torch::CustomClassHolder {
  enum Slot { kAev = 0, kAevGrad = 1, kSlots = 2 };

  // Makes `self` the calling thread's current workspace until exit().
  static void enter(const c10::intrusive_ptr<Workspace>& self);
  // Restores the one current before; `self` must be the current one.
  static void exit(const c10::intrusive_ptr<Workspace>& self);
  // Outputs smaller than this are never taken from a workspace.
  static int64_t min_bytes() { return static_cast<int64_t>(OutputCache::kMinBytes); }
  // Bytes held now (all slots).
  int64_t nbytes() {
    int64_t total = 0;
    for (OutputCache& s : slots) total += s.nbytes();
    return total;
  }

  OutputCache slots[kSlots];
};

// An uninitialised contiguous tensor like at::empty, from the calling thread's
// current workspace if it has one.
at::Tensor output_empty(Workspace::Slot slot, at::IntArrayRef sizes,
                        const at::TensorOptions& options);

}  // namespace torchani_fast
