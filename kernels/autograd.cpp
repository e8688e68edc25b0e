// Autograd for the AEV op, in C++ so that a TorchScript model loaded without
// Python (OpenMM-Torch, LAMMPS, torch.jit.load in a bare process) still
// differentiates. Both directions call the ops through the dispatcher, so every
// backend (CPU, CUDA, Meta) keeps its own kernels.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "ops.h"

namespace torchani_fast {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr const char* kAevSchema = "torchani_fast::aev";
constexpr const char* kAevBackwardSchema = "torchani_fast::aev_backward";

using AevSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                          double, int64_t);
using AevBackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, double, double, int64_t);

// Saved tensors, in schema order after the leading argument(s).
enum Saved { kSpecies, kPairs, kDiff, kREta, kRShifts, kAEta, kAZeta, kAShifts, kASections };

class AevFunction : public torch::autograd::Function<AevFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff,
                            const at::Tensor& r_eta, const at::Tensor& r_shifts,
                            const at::Tensor& a_eta, const at::Tensor& a_zeta,
                            const at::Tensor& a_shifts, const at::Tensor& a_sections,
                            double rc_r, double rc_a, int64_t num_species) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow(kAevSchema, "")
                         .typed<AevSig>();
    ctx->save_for_backward(
        {species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections});
    ctx->saved_data["rc_r"] = rc_r;
    ctx->saved_data["rc_a"] = rc_a;
    ctx->saved_data["num_species"] = num_species;
    return op.call(species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections,
                   rc_r, rc_a, num_species);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow(kAevBackwardSchema, "")
                         .typed<AevBackwardSig>();
    const auto s = ctx->get_saved_variables();
    at::Tensor grad_diff;
    if (ctx->needs_input_grad(kDiff)) {
      grad_diff = op.call(grads[0], s[kSpecies], s[kPairs], s[kDiff], s[kREta], s[kRShifts],
                          s[kAEta], s[kAZeta], s[kAShifts], s[kASections],
                          ctx->saved_data["rc_r"].toDouble(), ctx->saved_data["rc_a"].toDouble(),
                          ctx->saved_data["num_species"].toInt());
    }
    // Gradients w.r.t. the AEV constants are not computed (they are buffers in
    // every ANI model); undefined tensors tell autograd so.
    return {at::Tensor(), at::Tensor(), grad_diff, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class AevBackwardFunction : public torch::autograd::Function<AevBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad_aev,
                            const at::Tensor& species, const at::Tensor& pairs,
                            const at::Tensor& diff, const at::Tensor& r_eta,
                            const at::Tensor& r_shifts, const at::Tensor& a_eta,
                            const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                            const at::Tensor& a_sections, double rc_r, double rc_a,
                            int64_t num_species) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow(kAevBackwardSchema, "")
                         .typed<AevBackwardSig>();
    return op.call(grad_aev, species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts,
                   a_sections, rc_r, rc_a, num_species);
  }

  static tensor_list backward(AutogradContext*, tensor_list) {
    TORCH_CHECK(false,
                "torchani_fast::aev_backward: second derivatives (Hessians, force training) "
                "through the AEV op are not implemented in this version");
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> neighbor_pairs_autograd(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list) {
  // Integer-valued outputs: nothing to differentiate, so the call goes straight
  // to the backend and the outputs never require grad.
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchani_fast::neighbor_pairs", "")
                       .typed<decltype(neighbor_pairs_autograd)>();
  return op.call(species, coords, cell, pbc, cutoff, cell_list);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_autograd(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchani_fast::neighbor_pairs_padded", "")
                       .typed<decltype(neighbor_pairs_padded_autograd)>();
  return op.call(species, coords, cell, pbc, cutoff, cell_list, max_pairs);
}

at::Tensor aev_autograd(const at::Tensor& species, const at::Tensor& pairs,
                        const at::Tensor& diff_vectors, const at::Tensor& radial_eta,
                        const at::Tensor& radial_shifts, const at::Tensor& angular_eta,
                        const at::Tensor& angular_zeta, const at::Tensor& angular_shifts,
                        const at::Tensor& angular_sections, double radial_cutoff,
                        double angular_cutoff, int64_t num_species) {
  return AevFunction::apply(species, pairs, diff_vectors, radial_eta, radial_shifts,
                            angular_eta, angular_zeta, angular_shifts, angular_sections,
                            radial_cutoff, angular_cutoff, num_species);
}

at::Tensor aev_backward_autograd(const at::Tensor& grad_aev, const at::Tensor& species,
                                 const at::Tensor& pairs, const at::Tensor& diff_vectors,
                                 const at::Tensor& radial_eta, const at::Tensor& radial_shifts,
                                 const at::Tensor& angular_eta, const at::Tensor& angular_zeta,
                                 const at::Tensor& angular_shifts,
                                 const at::Tensor& angular_sections, double radial_cutoff,
                                 double angular_cutoff, int64_t num_species) {
  return AevBackwardFunction::apply(grad_aev, species, pairs, diff_vectors, radial_eta,
                                    radial_shifts, angular_eta, angular_zeta, angular_shifts,
                                    angular_sections, radial_cutoff, angular_cutoff, num_species);
}

}  // namespace torchani_fast
