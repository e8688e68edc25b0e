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

// The AEV arguments shared by every op, after the leading tensor(s): the nine
// tensors (species .. angular_sections) are saved after the leading ones, the
// three scalars in saved_data.
struct AevArgs {
  tensor_list t;  // species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections
  double rc_r, rc_a;
  int64_t num_species;
};

AevArgs make_args(const at::Tensor& species, const at::Tensor& pairs, const at::Tensor& diff,
                  const AEVParams& p) {
  return AevArgs{{species, pairs, diff, p.radial_eta, p.radial_shifts, p.angular_eta,
                  p.angular_zeta, p.angular_shifts, p.angular_sections},
                 p.radial_cutoff,
                 p.angular_cutoff,
                 p.num_species};
}

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

// Calls an AEV op through the dispatcher (every backend; autograd records the
// call when a higher derivative is being built, i.e. under create_graph=True).
template <typename Op>
c10::TypedOperatorHandle<typename Op::Schema> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<typename Op::Schema>();
}

template <typename Schema, typename... Lead>
auto call_op(const c10::TypedOperatorHandle<Schema>& op, const AevArgs& a, const Lead&... lead) {
  const auto& t = a.t;
  return op.call(lead..., t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], a.rc_r, a.rc_a,
                 a.num_species);
}

at::Tensor call_aev(const AevArgs& a) {
  static const auto op = find_op<AevForwardOp>("torchani_fast::aev");
  return call_op(op, a);
}

at::Tensor call_aev_backward(const at::Tensor& grad_aev, const AevArgs& a) {
  static const auto op = find_op<AevBackwardOp>("torchani_fast::aev_backward");
  return call_op(op, a, grad_aev);
}

at::Tensor call_aev_jvp(const at::Tensor& tangent, const AevArgs& a) {
  static const auto op = find_op<AevBackwardOp>("torchani_fast::aev_jvp");
  return call_op(op, a, tangent);
}

at::Tensor call_aev_double_backward(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                    const AevArgs& a) {
  static const auto op = find_op<AevDoubleBackwardOp>("torchani_fast::aev_double_backward");
  return call_op(op, a, grad_aev, tangent);
}

// The autograd Function of an AEV op with leading tensors Lead... (schema
// order: lead..., species, pairs, diff, constants). forward saves the first
// D::kSavedLead leading tensors and the AEV arguments and calls D::call;
// D::backward fills the input gradients it defines. Gradients w.r.t. the AEV
// constants are not computed (they are buffers in every ANI model): undefined
// tensors tell autograd so.
template <typename D, typename Op>
class AevFunction;

template <typename D, typename... Lead>
class AevFunction<D, AevOp<at::Tensor, Lead...>>
    : public torch::autograd::Function<AevFunction<D, AevOp<at::Tensor, Lead...>>> {
 public:
  static constexpr size_t kNumLead = sizeof...(Lead);

  static at::Tensor forward(AutogradContext* ctx, Lead... lead, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff,
                            const at::Tensor& r_eta, const at::Tensor& r_shifts,
                            const at::Tensor& a_eta, const at::Tensor& a_zeta,
                            const at::Tensor& a_shifts, const at::Tensor& a_sections,
                            double rc_r, double rc_a, int64_t num_species) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const AevArgs a{{species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections},
                    rc_r,
                    rc_a,
                    num_species};
    tensor_list saved{lead...};
    saved.resize(D::kSavedLead);
    save_aev_args(ctx, saved, a);
    return D::call(a, lead...);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    AevArgs a;
    const auto saved = load_aev_args(ctx, D::kSavedLead, a);
    tensor_list out(kNumLead + 12);
    D::backward(ctx, saved, grads[0], a, out);
    return out;
  }

  // The op's Autograd kernel (ops.h), AEVParams passed on flat.
  static at::Tensor kernel(Lead... lead, const at::Tensor& species, const at::Tensor& pairs,
                           const at::Tensor& diff, const AEVParams& p) {
    return AevFunction::apply(lead..., species, pairs, diff, p.radial_eta, p.radial_shifts,
                              p.angular_eta, p.angular_zeta, p.angular_shifts,
                              p.angular_sections, p.radial_cutoff, p.angular_cutoff,
                              p.num_species);
  }
};

// In every backward below, `w` is the incoming gradient and `out` is indexed in
// schema order (leading tensors, then species, pairs, diff, ...).

// aev(diff): its backward is aev_backward(w).
struct AevDerivs {
  static constexpr size_t kSavedLead = 0;
  static at::Tensor call(const AevArgs& a) { return call_aev(a); }
  static void backward(AutogradContext* ctx, const tensor_list&, const at::Tensor& w,
                       const AevArgs& a, tensor_list& out) {
    if (ctx->needs_input_grad(2)) out[2] = call_aev_backward(w, a);
  }
};

// aev_backward(g, diff) = J(diff)^T g. Its backward, for an incoming w (P, 3):
//   d/d g    <w, J^T g> = J w                          -> aev_jvp(w)
//   d/d diff <w, J^T g> = (sum_f g_f Hess aev_f) w     -> aev_double_backward(g, w)
struct AevBackwardDerivs {
  static constexpr size_t kSavedLead = 1;
  static at::Tensor call(const AevArgs& a, const at::Tensor& grad_aev) {
    return call_aev_backward(grad_aev, a);
  }
  static void backward(AutogradContext* ctx, const tensor_list& saved, const at::Tensor& w,
                       const AevArgs& a, tensor_list& out) {
    const at::Tensor& grad_aev = saved[0];
    if (ctx->needs_input_grad(0)) out[0] = call_aev_jvp(w, a).view(grad_aev.sizes());
    if (ctx->needs_input_grad(3)) out[3] = call_aev_double_backward(grad_aev, w, a);
  }
};

// aev_jvp(t, diff) = J(diff) t. For an incoming w (shape of the AEV):
//   d/d t    <w, J t> = J^T w                          -> aev_backward(w)
//   d/d diff <w, J t> = (sum_f w_f Hess aev_f) t       -> aev_double_backward(w, t)
struct AevJvpDerivs {
  static constexpr size_t kSavedLead = 1;
  static at::Tensor call(const AevArgs& a, const at::Tensor& tangent) {
    return call_aev_jvp(tangent, a);
  }
  static void backward(AutogradContext* ctx, const tensor_list& saved, const at::Tensor& w,
                       const AevArgs& a, tensor_list& out) {
    if (ctx->needs_input_grad(0)) out[0] = call_aev_backward(w, a);
    if (ctx->needs_input_grad(3)) out[3] = call_aev_double_backward(w, saved[0], a);
  }
};

// aev_double_backward(g, t, diff) = H(g, diff) t with H symmetric, so its
// derivative w.r.t. t is H(g, diff) w. Derivatives w.r.t. g and diff are third
// derivatives of the AEV: not implemented, and refused rather than dropped.
// Only g is saved.
struct AevDoubleBackwardDerivs {
  static constexpr size_t kSavedLead = 1;
  static at::Tensor call(const AevArgs& a, const at::Tensor& grad_aev, const at::Tensor& tangent) {
    return call_aev_double_backward(grad_aev, tangent, a);
  }
  static void backward(AutogradContext* ctx, const tensor_list& saved, const at::Tensor& w,
                       const AevArgs& a, tensor_list& out) {
    TORCH_CHECK(!ctx->needs_input_grad(0) && !ctx->needs_input_grad(4),
                "torchani_fast::aev_double_backward: third derivatives of the AEV (the "
                "derivative of a Hessian or of a force-training gradient with respect to "
                "coordinates or network outputs) are not implemented");
    if (ctx->needs_input_grad(1)) out[1] = call_aev_double_backward(saved[0], w, a);
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
                        const at::Tensor& diff_vectors, const AEVParams& p) {
  return AevFunction<AevDerivs, AevForwardOp>::kernel(species, pairs, diff_vectors, p);
}

at::Tensor aev_backward_autograd(const at::Tensor& grad_aev, const at::Tensor& species,
                                 const at::Tensor& pairs, const at::Tensor& diff_vectors,
                                 const AEVParams& p) {
  return AevFunction<AevBackwardDerivs, AevBackwardOp>::kernel(grad_aev, species, pairs,
                                                               diff_vectors, p);
}

at::Tensor aev_jvp_autograd(const at::Tensor& tangent, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const AEVParams& p) {
  return AevFunction<AevJvpDerivs, AevBackwardOp>::kernel(tangent, species, pairs, diff_vectors,
                                                          p);
}

at::Tensor aev_double_backward_autograd(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                        const at::Tensor& species, const at::Tensor& pairs,
                                        const at::Tensor& diff_vectors, const AEVParams& p) {
  return AevFunction<AevDoubleBackwardDerivs, AevDoubleBackwardOp>::kernel(
      grad_aev, tangent, species, pairs, diff_vectors, p);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_autograd(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p) {
  // Building blocks of whole Hessians, evaluated under no_grad: refuse rather
  // than return outputs that would silently not differentiate.
  TORCH_CHECK(!(at::GradMode::is_enabled() &&
                (grad_aev.requires_grad() || diff_vectors.requires_grad())),
              "torchani_fast::aev_local_derivatives is not differentiable: call it under "
              "torch.no_grad() or with detached grad_aev and diff_vectors");
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto op = find_op<AevLocalDerivativesOp>("torchani_fast::aev_local_derivatives");
  return call_op(op, make_args(species, pairs, diff_vectors, p), grad_aev, columns);
}

}  // namespace torchani_fast
