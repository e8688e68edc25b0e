// PackCache (torch.classes.torchani_fast.PackCache): the packed weights of one
// fused networks module, eager or scripted, and how it tells that they are
// stale. The one mechanism for both (torchani_fast/nn/fused.py):
//
//   packs   int key -> list of tensors (layer-1 packs, hidden packs, panels),
//           in insertion order; at most `max_first` entries with keys >= 0
//           (layer-1 packs): put() drops the oldest of those beyond it;
//   params  the parameters the packs derive from (watch()), held here so that
//           an eager caller does not convert a Python list on every call;
//   check() -1 while a parameter requires grad (training: nothing may be
//           cached); else the epoch, after dropping every pack if a parameter
//           changed since the last check (weights_state's fingerprint: new
//           storage, offset or version counter).
//
// The epoch grows whenever a pack is dropped: arguments built from the packs
// earlier (the eager module's per-composition plans) are valid while the epoch
// they were built at is the current one. Methods lock: one module may be called
// from several threads. It pickles as empty (torch.jit.save writes the weights
// only; a copy or a loaded module starts with an empty cache that watches
// nothing, check() = -2). dict() is kept for modules scripted and saved by
// torchani_fast before 0.2, whose code reads the packs through it.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "ops.h"

namespace torchani_fast {

struct PackCache : torch::CustomClassHolder {
  using Packs = c10::List<at::Tensor>;

  void watch(std::vector<at::Tensor> tensors) {
    std::lock_guard<std::mutex> lock(mutex_);
    params_ = std::move(tensors);
    watching_ = true;
    fingerprint_ = std::get<1>(weights_state(params_));
    drop_all();
  }

  int64_t check() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!watching_) return -2;
    const auto [requires_grad, fingerprint] = weights_state(params_);
    if (requires_grad) return -1;
    if (fingerprint != fingerprint_) {
      fingerprint_ = fingerprint;
      drop_all();
    }
    return epoch_;
  }

  std::optional<Packs> get(int64_t key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return std::nullopt;
    return it->value();
  }

  // Stores (or replaces) an entry; a new layer-1 pack (key >= 0) first drops
  // the oldest one if `max_first` of them are held.
  void put(int64_t key, Packs value, int64_t max_first) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (key >= 0 && !entries_.contains(key)) {
      int64_t firsts = 0, oldest = -1;
      for (const auto& entry : entries_) {  // insertion order: the first found is the oldest
        if (entry.key() < 0) continue;
        if (firsts++ == 0) oldest = entry.key();
      }
      if (firsts >= max_first && oldest >= 0) {
        entries_.erase(oldest);
        ++epoch_;
      }
    }
    entries_.insert_or_assign(key, std::move(value));
  }

  // The epoch now, without checking the parameters.
  int64_t epoch() {
    std::lock_guard<std::mutex> lock(mutex_);
    return epoch_;
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_all();
  }

  std::vector<int64_t> keys() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> out;
    for (const auto& entry : entries_) out.push_back(entry.key());
    return out;
  }

  // Every tensor held: a caller that replays kernels reading them (a CUDA
  // graph) keeps this list, so that the memory stays valid after a clear().
  std::vector<at::Tensor> tensors() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<at::Tensor> out;
    for (const auto& entry : entries_)
      for (const at::Tensor& t : entry.value()) out.push_back(t);
    return out;
  }

  c10::Dict<int64_t, Packs> dict() const { return entries_; }

 private:
  void drop_all() {
    entries_.clear();
    ++epoch_;
  }

  std::mutex mutex_;
  c10::Dict<int64_t, Packs> entries_;
  std::vector<at::Tensor> params_;
  bool watching_ = false;
  int64_t fingerprint_ = 0;
  int64_t epoch_ = 0;
};

}  // namespace torchani_fast
