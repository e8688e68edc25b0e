// Autograd for the AEV ops, in C++ so that a TorchScript model loaded without
// Python (OpenMM-Torch, LAMMPS, torch.jit.load in a bare process) still
// differentiates, twice (Hessians, force training). Both directions call the ops through the dispatcher, so every
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

// The AEV arguments shared by every op, after the leading tensor(s): the nine
// tensors (species .. angular_sections) are saved after the leading ones, the
// three scalars in saved_data.
struct AevArgs {
  tensor_list t;  // species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections
  double rc_r, rc_a;
  int64_t num_species;
  const at::Tensor& diff() const { return t[kDiff]; }
};

void save_aev_args(AutogradContext* ctx, tensor_list leading, const AevArgs& a) {
  leading.insert(leading.end(), a.t.begin(), a.t.end());
  ctx->save_for_backward(leading);
  ctx->saved_data["rc_r"] = a.rc_r;
  ctx->saved_data["rc_a"] = a.rc_a;
  ctx->saved_data["num_species"] = a.num_species;
}

// Returns the leading saved tensors and fills `a` with the rest.
tensor_list load_aev_args(AutogradContext* ctx, size_t num_leading, AevArgs& a) {
  auto s = ctx->get_saved_variables();
  a.t.assign(s.begin() + num_leading, s.end());
  a.rc_r = ctx->saved_data["rc_r"].toDouble();
  a.rc_a = ctx->saved_data["rc_a"].toDouble();
  a.num_species = ctx->saved_data["num_species"].toInt();
  return tensor_list(s.begin(), s.begin() + num_leading);
}

using AevJvpSig = AevBackwardSig;  // (Tensor tangent, AEV args...)
using AevDoubleBackwardSig =
    at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
               const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, int64_t);

// Calls through the dispatcher (every backend; autograd records them when a
// higher derivative is being built, i.e. under create_graph=True).
at::Tensor call_aev_backward(const at::Tensor& grad_aev, const AevArgs& a) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kAevBackwardSchema, "").typed<AevBackwardSig>();
  const auto& t = a.t;
  return op.call(grad_aev, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], a.rc_r, a.rc_a,
                 a.num_species);
}

at::Tensor call_aev_jvp(const at::Tensor& tangent, const AevArgs& a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchani_fast::aev_jvp", "")
                       .typed<AevJvpSig>();
  const auto& t = a.t;
  return op.call(tangent, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], a.rc_r, a.rc_a,
                 a.num_species);
}

at::Tensor call_aev_double_backward(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                    const AevArgs& a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchani_fast::aev_double_backward", "")
                       .typed<AevDoubleBackwardSig>();
  const auto& t = a.t;
  return op.call(grad_aev, tangent, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], a.rc_r,
                 a.rc_a, a.num_species);
}

AevArgs make_args(const at::Tensor& species, const at::Tensor& pairs, const at::Tensor& diff,
                  const at::Tensor& r_eta, const at::Tensor& r_shifts, const at::Tensor& a_eta,
                  const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                  const at::Tensor& a_sections, double rc_r, double rc_a, int64_t num_species) {
  return AevArgs{{species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections},
                 rc_r,
                 rc_a,
                 num_species};
}

// aev_backward(g, diff) = J(diff)^T g. Its backward, for an incoming w (P, 3):
//   d/d g    <w, J^T g> = J w                          -> aev_jvp(w)
//   d/d diff <w, J^T g> = (sum_f g_f Hess aev_f) w     -> aev_double_backward(g, w)
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
    const auto args = make_args(species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts,
                                a_sections, rc_r, rc_a, num_species);
    save_aev_args(ctx, {grad_aev}, args);
    return call_aev_backward(grad_aev, args);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    AevArgs a;
    const auto lead = load_aev_args(ctx, 1, a);
    const at::Tensor& grad_aev = lead[0];
    const at::Tensor& w = grads[0];
    tensor_list out(13);
    // Input order: grad_aev, species, pairs, diff, ...
    if (ctx->needs_input_grad(0)) out[0] = call_aev_jvp(w, a).view(grad_aev.sizes());
    if (ctx->needs_input_grad(3)) out[3] = call_aev_double_backward(grad_aev, w, a);
    return out;
  }
};

// aev_jvp(t, diff) = J(diff) t. For an incoming w (shape of the AEV):
//   d/d t    <w, J t> = J^T w                          -> aev_backward(w)
//   d/d diff <w, J t> = (sum_f w_f Hess aev_f) t       -> aev_double_backward(w, t)
class AevJvpFunction : public torch::autograd::Function<AevJvpFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tangent,
                            const at::Tensor& species, const at::Tensor& pairs,
                            const at::Tensor& diff, const at::Tensor& r_eta,
                            const at::Tensor& r_shifts, const at::Tensor& a_eta,
                            const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                            const at::Tensor& a_sections, double rc_r, double rc_a,
                            int64_t num_species) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto args = make_args(species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts,
                                a_sections, rc_r, rc_a, num_species);
    save_aev_args(ctx, {tangent}, args);
    return call_aev_jvp(tangent, args);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    AevArgs a;
    const auto lead = load_aev_args(ctx, 1, a);
    const at::Tensor& tangent = lead[0];
    const at::Tensor& w = grads[0];
    tensor_list out(13);
    // Input order: tangent, species, pairs, diff, ...
    if (ctx->needs_input_grad(0)) out[0] = call_aev_backward(w, a);
    if (ctx->needs_input_grad(3)) out[3] = call_aev_double_backward(w, tangent, a);
    return out;
  }
};

// aev_double_backward(g, t, diff) = H(g, diff) t with H symmetric, so its
// derivative w.r.t. t is H(g, diff) w. Derivatives w.r.t. g and diff are third
// derivatives of the AEV: not implemented, and refused rather than dropped.
class AevDoubleBackwardFunction : public torch::autograd::Function<AevDoubleBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad_aev,
                            const at::Tensor& tangent, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff,
                            const at::Tensor& r_eta, const at::Tensor& r_shifts,
                            const at::Tensor& a_eta, const at::Tensor& a_zeta,
                            const at::Tensor& a_shifts, const at::Tensor& a_sections,
                            double rc_r, double rc_a, int64_t num_species) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto args = make_args(species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts,
                                a_sections, rc_r, rc_a, num_species);
    save_aev_args(ctx, {grad_aev}, args);
    return call_aev_double_backward(grad_aev, tangent, args);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    // Input order: grad_aev, tangent, species, pairs, diff, ...
    TORCH_CHECK(!ctx->needs_input_grad(0) && !ctx->needs_input_grad(4),
                "torchani_fast::aev_double_backward: third derivatives of the AEV (the "
                "derivative of a Hessian or of a force-training gradient with respect to "
                "coordinates or network outputs) are not implemented");
    AevArgs a;
    const auto lead = load_aev_args(ctx, 1, a);
    tensor_list out(14);
    if (ctx->needs_input_grad(1)) out[1] = call_aev_double_backward(lead[0], grads[0], a);
    return out;
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

at::Tensor aev_jvp_autograd(const at::Tensor& tangent, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const at::Tensor& radial_eta, const at::Tensor& radial_shifts,
                            const at::Tensor& angular_eta, const at::Tensor& angular_zeta,
                            const at::Tensor& angular_shifts, const at::Tensor& angular_sections,
                            double radial_cutoff, double angular_cutoff, int64_t num_species) {
  return AevJvpFunction::apply(tangent, species, pairs, diff_vectors, radial_eta, radial_shifts,
                               angular_eta, angular_zeta, angular_shifts, angular_sections,
                               radial_cutoff, angular_cutoff, num_species);
}

at::Tensor aev_double_backward_autograd(
    const at::Tensor& grad_aev, const at::Tensor& tangent, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const at::Tensor& radial_eta,
    const at::Tensor& radial_shifts, const at::Tensor& angular_eta,
    const at::Tensor& angular_zeta, const at::Tensor& angular_shifts,
    const at::Tensor& angular_sections, double radial_cutoff, double angular_cutoff,
    int64_t num_species) {
  return AevDoubleBackwardFunction::apply(grad_aev, tangent, species, pairs, diff_vectors,
                                          radial_eta, radial_shifts, angular_eta, angular_zeta,
                                          angular_shifts, angular_sections, radial_cutoff,
                                          angular_cutoff, num_species);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_autograd(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const at::Tensor& radial_eta,
    const at::Tensor& radial_shifts, const at::Tensor& angular_eta,
    const at::Tensor& angular_zeta, const at::Tensor& angular_shifts,
    const at::Tensor& angular_sections, double radial_cutoff, double angular_cutoff,
    int64_t num_species) {
  // Building blocks of whole Hessians, evaluated under no_grad: refuse rather
  // than return outputs that would silently not differentiate.
  TORCH_CHECK(!(at::GradMode::is_enabled() &&
                (grad_aev.requires_grad() || diff_vectors.requires_grad())),
              "torchani_fast::aev_local_derivatives is not differentiable: call it under "
              "torch.no_grad() or with detached grad_aev and diff_vectors");
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchani_fast::aev_local_derivatives", "")
                       .typed<decltype(aev_local_derivatives_autograd)>();
  return op.call(grad_aev, columns, species, pairs, diff_vectors, radial_eta, radial_shifts,
                 angular_eta, angular_zeta, angular_shifts, angular_sections, radial_cutoff,
                 angular_cutoff, num_species);
}

}  // namespace torchani_fast
