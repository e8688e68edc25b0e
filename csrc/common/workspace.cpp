// The calling thread's current Workspace (common/workspace.h).
#include "common/workspace.h"

#include <vector>

namespace torchani_fast {
namespace {
// The workspaces entered and not yet exited in this thread, innermost last.
thread_local std::vector<c10::intrusive_ptr<Workspace>> entered;
}  // namespace

void Workspace::enter(const c10::intrusive_ptr<Workspace>& self) { entered.push_back(self); }

void Workspace::exit(const c10::intrusive_ptr<Workspace>& self) {
  TORCH_CHECK(!entered.empty() && entered.back().get() == self.get(),
              "Workspace.exit: this workspace is not the current one of this thread (exit the "
              "workspaces in the reverse order of entering them, in the thread that entered them)");
  entered.pop_back();
}

at::Tensor output_empty(Workspace::Slot slot, at::IntArrayRef sizes,
                        const at::TensorOptions& options) {
  if (entered.empty() || options.device().type() != at::kCPU) return at::empty(sizes, options);
  return entered.back()->slots[slot].empty(sizes, options);
}

}  // namespace torchani_fast
