// Autograd for the AEV ops and for ensemble_atomic (the fused networks), in C++
// so that a TorchScript model loaded without Python (OpenMM-Torch, LAMMPS,
// torch.jit.load in a bare process) still differentiates, twice (Hessians,
// force training). Both directions call the ops through the dispatcher, so
// every backend (CPU, CUDA, Meta) keeps its own kernels.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "ensemble/aten_mlp.h"
#include "ops.h"
#include "pairpot/pairpot.h"

namespace torchani_fast {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// The AEV arguments shared by every op, after the leading tensor(s): the nine
// tensors (species .. angular_sections) are saved after the leading ones, the
// six scalars in saved_data.
struct AevArgs {
  tensor_list t;  // species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections
  double rc_r, rc_a;
  int64_t num_species;
  int64_t cut_kind, cut_order;  // the cutoff function (AEVParams)
  double cut_eps;
};

AevArgs make_args(const at::Tensor& species, const at::Tensor& pairs, const at::Tensor& diff,
                  const AEVParams& p) {
  return AevArgs{{species, pairs, diff, p.radial_eta, p.radial_shifts, p.angular_eta,
                  p.angular_zeta, p.angular_shifts, p.angular_sections},
                 p.radial_cutoff,
                 p.angular_cutoff,
                 p.num_species,
                 p.cutoff_kind,
                 p.cutoff_order,
                 p.cutoff_eps};
}

void save_aev_args(AutogradContext* ctx, tensor_list leading, const AevArgs& a) {
  leading.insert(leading.end(), a.t.begin(), a.t.end());
  ctx->save_for_backward(leading);
  ctx->saved_data["rc_r"] = a.rc_r;
  ctx->saved_data["rc_a"] = a.rc_a;
  ctx->saved_data["num_species"] = a.num_species;
  ctx->saved_data["cut_kind"] = a.cut_kind;
  ctx->saved_data["cut_order"] = a.cut_order;
  ctx->saved_data["cut_eps"] = a.cut_eps;
}

// Returns the leading saved tensors and fills `a` with the rest.
tensor_list load_aev_args(AutogradContext* ctx, size_t num_leading, AevArgs& a) {
  auto s = ctx->get_saved_variables();
  a.t.assign(s.begin() + num_leading, s.end());
  a.rc_r = ctx->saved_data["rc_r"].toDouble();
  a.rc_a = ctx->saved_data["rc_a"].toDouble();
  a.num_species = ctx->saved_data["num_species"].toInt();
  a.cut_kind = ctx->saved_data["cut_kind"].toInt();
  a.cut_order = ctx->saved_data["cut_order"].toInt();
  a.cut_eps = ctx->saved_data["cut_eps"].toDouble();
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
                 a.num_species, a.cut_kind, a.cut_order, a.cut_eps);
}

at::Tensor call_aev(const AevArgs& a) {
  static const auto op = find_op<AevForwardOp>("torchani_fast::aev");
  return call_op(op, a);
}

at::Tensor call_aev_backward(const at::Tensor& grad_aev, const AevArgs& a) {
  static const auto op = find_op<AevBackwardOp>("torchani_fast::aev_backward");
  return call_op(op, a, grad_aev);
}

std::tuple<at::Tensor, at::Tensor> call_aev_with_edges(const AevArgs& a) {
  static const auto op = find_op<AevWithEdgesOp>("torchani_fast::aev_with_edges");
  return call_op(op, a);
}

at::Tensor call_aev_backward_edges(const at::Tensor& grad_aev, const at::Tensor& edges,
                                   const AevArgs& a) {
  static const auto op = find_op<AevBackwardEdgesOp>("torchani_fast::aev_backward_edges");
  return call_op(op, a, grad_aev, edges);
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
                            double rc_r, double rc_a, int64_t num_species, int64_t cut_kind,
                            int64_t cut_order, double cut_eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const AevArgs a{{species, pairs, diff, r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections},
                    rc_r,
                    rc_a,
                    num_species,
                    cut_kind,
                    cut_order,
                    cut_eps};
    tensor_list saved{lead...};
    saved.resize(D::kSavedLead);
    save_aev_args(ctx, saved, a);
    return D::call(ctx, a, lead...);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    AevArgs a;
    const auto saved = load_aev_args(ctx, D::kSavedLead, a);
    tensor_list out(kNumLead + 15);
    D::backward(ctx, saved, grads[0], a, out);
    return out;
  }

  // The op's Autograd kernel (ops.h), AEVParams passed on flat.
  static at::Tensor kernel(Lead... lead, const at::Tensor& species, const at::Tensor& pairs,
                           const at::Tensor& diff, const AEVParams& p) {
    return AevFunction::apply(lead..., species, pairs, diff, p.radial_eta, p.radial_shifts,
                              p.angular_eta, p.angular_zeta, p.angular_shifts,
                              p.angular_sections, p.radial_cutoff, p.angular_cutoff,
                              p.num_species, p.cutoff_kind, p.cutoff_order, p.cutoff_eps);
  }
};

// In every backward below, `w` is the incoming gradient and `out` is indexed in
// schema order (leading tensors, then species, pairs, diff, ...).

// aev(diff): its backward is aev_backward(w). The forward's half edges travel
// to it in the context: aev_with_edges returns their handle (an empty tensor
// where none are kept), aev_backward_edges reads it (ops.h).
struct AevDerivs {
  static constexpr size_t kSavedLead = 0;
  static at::Tensor call(AutogradContext* ctx, const AevArgs& a) {
    if (!a.t[2].requires_grad()) return call_aev(a);
    auto [aev, edges] = call_aev_with_edges(a);
    ctx->saved_data["edges"] = edges;
    return aev;
  }
  static void backward(AutogradContext* ctx, const tensor_list&, const at::Tensor& w,
                       const AevArgs& a, tensor_list& out) {
    if (!ctx->needs_input_grad(2)) return;
    auto edges = ctx->saved_data.find("edges");
    out[2] = edges == ctx->saved_data.end() ? call_aev_backward(w, a)
                                            : call_aev_backward_edges(w, edges->second.toTensor(), a);
  }
};

// aev_backward(g, diff) = J(diff)^T g. Its backward, for an incoming w (P, 3):
//   d/d g    <w, J^T g> = J w                          -> aev_jvp(w)
//   d/d diff <w, J^T g> = (sum_f g_f Hess aev_f) w     -> aev_double_backward(g, w)
// aev_backward_edges is the same function (its handle only saves work), so its
// derivatives are too, with diff one place further (kDiff).
template <size_t kDiff>
struct AevBackwardDerivsAt {
  static constexpr size_t kSavedLead = 1;
  static at::Tensor call(AutogradContext*, const AevArgs& a, const at::Tensor& grad_aev) {
    return call_aev_backward(grad_aev, a);
  }
  static at::Tensor call(AutogradContext*, const AevArgs& a, const at::Tensor& grad_aev,
                         const at::Tensor& edges) {
    return call_aev_backward_edges(grad_aev, edges, a);
  }
  static void backward(AutogradContext* ctx, const tensor_list& saved, const at::Tensor& w,
                       const AevArgs& a, tensor_list& out) {
    const at::Tensor& grad_aev = saved[0];
    if (ctx->needs_input_grad(0)) out[0] = call_aev_jvp(w, a).view(grad_aev.sizes());
    if (ctx->needs_input_grad(kDiff)) out[kDiff] = call_aev_double_backward(grad_aev, w, a);
  }
};
using AevBackwardDerivs = AevBackwardDerivsAt<3>;
using AevBackwardEdgesDerivs = AevBackwardDerivsAt<4>;

// aev_jvp(t, diff) = J(diff) t. For an incoming w (shape of the AEV):
//   d/d t    <w, J t> = J^T w                          -> aev_backward(w)
//   d/d diff <w, J t> = (sum_f w_f Hess aev_f) t       -> aev_double_backward(w, t)
struct AevJvpDerivs {
  static constexpr size_t kSavedLead = 1;
  static at::Tensor call(AutogradContext*, const AevArgs& a, const at::Tensor& tangent) {
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
  static at::Tensor call(AutogradContext*, const AevArgs& a, const at::Tensor& grad_aev,
                         const at::Tensor& tangent) {
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

// ---------------------------------------------------------------------------
// ensemble_atomic / ensemble_energies: the networks' values (members, atoms)
// or energies (molecules,), differentiable in aev.
// ---------------------------------------------------------------------------

constexpr int64_t kRecomputeChunk = 1024;  // atoms per chunk of the recomputation

// The AEV gradient of sum(grad_values * values) by recomputing each group's
// activations with differentiable ATen ops, a chunk of atoms at a time (any
// incoming gradient (members, atoms); recorded when grad mode is on, i.e.
// under create_graph=True, so that it can be differentiated again).
at::Tensor recompute_aev_grad(const at::Tensor& aev, const at::Tensor& grad_values,
                              const at::Tensor& atoms, const std::vector<int64_t>& sizes,
                              const std::vector<at::Tensor>& columns,
                              const std::vector<at::Tensor>& first,
                              const std::vector<at::Tensor>& packs,
                              const std::vector<int64_t>& layers, int64_t members,
                              int64_t activation) {
  const bool differentiable = at::GradMode::is_enabled();
  at::Tensor result = at::zeros_like(aev);
  int64_t row = 0, pack = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const std::vector<at::Tensor> group_packs(packs.begin() + pack,
                                              packs.begin() + pack + 2 * layers[g] - 1);
    const at::Tensor& cols = columns[g];
    const bool all_columns = cols.numel() == aev.size(1);
    for (int64_t r0 = 0; r0 < sizes[g]; r0 += kRecomputeChunk) {
      const at::Tensor chunk = atoms.narrow(0, row + r0, std::min(kRecomputeChunk, sizes[g] - r0));
      at::Tensor x = aev.index_select(0, chunk);
      if (!all_columns) x = x.index_select(1, cols);
      const at::Tensor gx = aten_mlp::input_grad(x, grad_values.index_select(1, chunk), first[g],
                                                 group_packs, members, activation);
      c10::List<std::optional<at::Tensor>> index;
      index.push_back(all_columns ? chunk : chunk.unsqueeze(1));
      if (!all_columns) index.push_back(cols.unsqueeze(0));
      result = differentiable ? at::index_put(result, index, gx) : result.index_put_(index, gx);
    }
    row += sizes[g];
    pack += 2 * layers[g] - 1;
  }
  return result;
}

// The networks' values (members, atoms), or with molecules > 0 their
// reduction to energies (molecules,) (ensemble_energies: one autograd node for
// the networks of an energy + forces call), differentiable in aev. The weights
// are constants (packed copies that never require grad): kept in saved_data,
// not as inputs.
class EnsembleFunction : public torch::autograd::Function<EnsembleFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& aev, const at::Tensor& atoms,
                            std::vector<int64_t> sizes, std::vector<at::Tensor> columns,
                            std::vector<at::Tensor> first, std::vector<at::Tensor> packs,
                            std::vector<at::Tensor> panels, std::vector<int64_t> layers,
                            int64_t members, int64_t molecules, int64_t divisor,
                            bool zero_blocks_exact, int64_t activation) {
    at::AutoDispatchBelowADInplaceOrView guard;
    if (molecules > 0) check_energies_args(aev, molecules, divisor);
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("torchani_fast::ensemble_mlp", "")
                               .typed<std::tuple<at::Tensor, at::Tensor>(
                                   const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                   at::TensorList, at::TensorList, at::TensorList,
                                   at::TensorList, at::IntArrayRef, int64_t, bool, bool,
                                   int64_t)>();
    auto [values, jac] = op.call(aev, atoms, sizes, columns, first, packs, panels, layers,
                                 members, true, zero_blocks_exact, activation);
    ctx->save_for_backward({aev});
    ctx->saved_data["atoms"] = atoms;
    ctx->saved_data["jac"] = jac;
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["columns"] = columns;
    ctx->saved_data["first"] = first;
    ctx->saved_data["packs"] = packs;
    ctx->saved_data["layers"] = layers;
    ctx->saved_data["members"] = members;
    ctx->saved_data["molecules"] = molecules;
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["activation"] = activation;
    return molecules > 0 ? energies_from_values(values, molecules, divisor) : values;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const at::Tensor aev = ctx->get_saved_variables()[0];
    const at::Tensor atoms = ctx->saved_data["atoms"].toTensor();
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const auto columns = ctx->saved_data["columns"].toTensorVector();
    const int64_t members = ctx->saved_data["members"].toInt();
    const int64_t molecules = ctx->saved_data["molecules"].toInt();
    // Grad mode is on here only under create_graph=True: then the backward is
    // recorded, so that it can be differentiated again.
    const bool differentiable = at::GradMode::is_enabled();
    at::Tensor grad_values = grads[0];  // (members, atoms)
    if (molecules > 0) {
      // The reduction's backward, as autograd would run it on the ATen
      // reduction: grad / divisor, spread over each molecule's atoms and over
      // the members (one row is enough for grad * J).
      const int64_t rows = differentiable ? members : 1;
      grad_values = grads[0]
                        .div(ctx->saved_data["divisor"].toInt())
                        .view({1, molecules, 1})
                        .expand({rows, molecules, aev.size(0) / molecules})
                        .reshape({rows, aev.size(0)});
    }
    tensor_list out(13);
    if (!differentiable) {
      static const auto op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("torchani_fast::ensemble_mlp_backward", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                   at::IntArrayRef, at::TensorList,
                                                   const at::Tensor&, int64_t)>();
      at::Tensor g = op.call(grad_values, atoms, sizes, columns,
                             ctx->saved_data["jac"].toTensor(), aev.size(1));
      if (g.dim() == 2) {  // every member had the same incoming gradient: grad * J
        out[0] = g;
        return out;
      }
    }
    out[0] = recompute_aev_grad(aev, grad_values, atoms, sizes, columns,
                                ctx->saved_data["first"].toTensorVector(),
                                ctx->saved_data["packs"].toTensorVector(),
                                ctx->saved_data["layers"].toIntVector(), members,
                                ctx->saved_data["activation"].toInt());
    return out;
  }
};

}  // namespace

at::Tensor ensemble_atomic_autograd(const at::Tensor& aev, const at::Tensor& atoms,
                                    at::IntArrayRef sizes, at::TensorList columns,
                                    at::TensorList first, at::TensorList packs,
                                    at::TensorList panels, at::IntArrayRef layers,
                                    int64_t members, bool zero_blocks_exact, int64_t activation) {
  if (!(at::GradMode::is_enabled() && aev.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("torchani_fast::ensemble_atomic", "")
                               .typed<decltype(ensemble_atomic_autograd)>();
    return op.call(aev, atoms, sizes, columns, first, packs, panels, layers, members,
                   zero_blocks_exact, activation);
  }
  return EnsembleFunction::apply(aev, atoms, sizes.vec(), columns.vec(), first.vec(), packs.vec(),
                                 panels.vec(), layers.vec(), members, 0, 1, zero_blocks_exact,
                                 activation);
}

at::Tensor ensemble_energies_autograd(const at::Tensor& aev, const at::Tensor& atoms,
                                      at::IntArrayRef sizes, at::TensorList columns,
                                      at::TensorList first, at::TensorList packs,
                                      at::TensorList panels, at::IntArrayRef layers,
                                      int64_t members, int64_t molecules, int64_t divisor,
                                      bool zero_blocks_exact, int64_t activation) {
  if (!(at::GradMode::is_enabled() && aev.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("torchani_fast::ensemble_energies", "")
                               .typed<decltype(ensemble_energies_autograd)>();
    return op.call(aev, atoms, sizes, columns, first, packs, panels, layers, members, molecules,
                   divisor, zero_blocks_exact, activation);
  }
  return EnsembleFunction::apply(aev, atoms, sizes.vec(), columns.vec(), first.vec(), packs.vec(),
                                 panels.vec(), layers.vec(), members, molecules, divisor,
                                 zero_blocks_exact, activation);
}

namespace {

// pair_vectors, differentiable w.r.t. coords and cell (images and pairs are
// integer-valued). The vectors' total gradient (with the lengths' share) and
// the cell's are formed here once; the scatter to the coordinates is one pass
// over the pairs (pair_vectors_backward), or ATen's index_add under
// create_graph=True, which autograd records for the next derivative.
class PairVectorsFunction : public torch::autograd::Function<PairVectorsFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const at::Tensor& coords,
                             const at::Tensor& pairs, const std::optional<at::Tensor>& images,
                             const std::optional<at::Tensor>& cell) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("torchani_fast::pair_vectors", "")
                               .typed<decltype(pair_vectors_autograd)>();
    auto [diff, dist] = op.call(coords, pairs, images, cell);
    // An output without a gradient (usually the distances) stays undefined in
    // backward instead of arriving as zeros that would be multiplied through.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({pairs, diff, dist, images.value_or(at::Tensor())});
    ctx->saved_data["num_atoms"] = coords.size(0);
    return {diff, dist};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& pairs = saved[0];
    const at::Tensor& diff = saved[1];
    const at::Tensor& dist = saved[2];
    const at::Tensor& images = saved[3];  // undefined without a cell
    const int64_t num_atoms = ctx->saved_data["num_atoms"].toInt();
    // grad_diff + grad_dist * diff / |diff| (0 at |diff| = 0, as for torch.norm).
    at::Tensor g = grads[0].defined() ? grads[0] : at::zeros_like(diff);
    if (grads[1].defined())
      g = g + at::where(dist == 0, at::zeros_like(dist), grads[1] / dist).unsqueeze(-1) * diff;
    tensor_list out(4);
    if (at::GradMode::is_enabled()) {
      out[0] = at::zeros({num_atoms, 3}, diff.options())
                   .index_add(0, pairs[0], g)
                   .index_add(0, pairs[1], -g);
    } else {
      static const auto op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("torchani_fast::pair_vectors_backward", "")
                                 .typed<decltype(pair_vectors_backward_cpu)>();
      out[0] = op.call(g, pairs, num_atoms);
    }
    // needs_input_grad counts the tensor inputs given: cell is the fourth when images is there.
    if (images.defined() && ctx->needs_input_grad(3)) out[3] = at::mm(images.t(), g);
    return out;
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> pair_vectors_autograd(const at::Tensor& coords,
                                                         const at::Tensor& pairs,
                                                         const c10::optional<at::Tensor>& images,
                                                         const c10::optional<at::Tensor>& cell) {
  const tensor_list out = PairVectorsFunction::apply(coords, pairs, images, cell);
  return {out[0], out[1]};
}

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

at::Tensor aev_backward_edges_autograd(const at::Tensor& grad_aev, const at::Tensor& edges,
                                       const at::Tensor& species, const at::Tensor& pairs,
                                       const at::Tensor& diff_vectors, const AEVParams& p) {
  return AevFunction<AevBackwardEdgesDerivs, AevBackwardEdgesOp>::kernel(grad_aev, edges, species,
                                                                         pairs, diff_vectors, p);
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

// ---------------------------------------------------------------------------
// repulsion_xtb / dispersion_d3: energies differentiable w.r.t. the distances
// (the tables are buffers: constants). The forward keeps the per-pair factors
// of the gradient (derivs); the backward is pair_energies_backward on them, or,
// when it is itself recorded (create_graph=True), the differentiable ATen form
// of the same gradient, which autograd differentiates for Hessians.
// ---------------------------------------------------------------------------
namespace {

void save_pair_cutoff(AutogradContext* ctx, double a2b, const PairCutoff& c) {
  ctx->saved_data["a2b"] = a2b;
  ctx->saved_data["cutoff"] = c.cutoff;
  ctx->saved_data["cut_kind"] = c.kind;
  ctx->saved_data["cut_order"] = c.order;
  ctx->saved_data["cut_eps"] = c.eps;
}

PairCutoff load_pair_cutoff(AutogradContext* ctx) {
  return PairCutoff{ctx->saved_data["cutoff"].toDouble(), ctx->saved_data["cut_kind"].toInt(),
                    ctx->saved_data["cut_order"].toInt(), ctx->saved_data["cut_eps"].toDouble()};
}

struct RepulsionTraits {
  using Params = RepulsionParams;
  static constexpr const char* kName = "torchani_fast::repulsion_xtb";
  static void save(AutogradContext* ctx, const Params& p) {
    ctx->saved_data["tables"] = std::vector<at::Tensor>{p.y_ab, p.sqrt_alpha_ab, p.k_rep_ab};
    save_pair_cutoff(ctx, p.angstrom_to_bohr, p.cut);
  }
  static Params load(AutogradContext* ctx) {
    const auto t = ctx->saved_data["tables"].toTensorVector();
    return Params{t[0], t[1], t[2], ctx->saved_data["a2b"].toDouble(), load_pair_cutoff(ctx)};
  }
  static at::Tensor grad_aten(const at::Tensor& grad, const at::Tensor& elem,
                              const at::Tensor& pairs, const at::Tensor& distances,
                              const c10::optional<at::Tensor>& ghost, bool atomic,
                              const Params& p) {
    return repulsion_grad_aten(grad, elem, pairs, distances, ghost, atomic, p);
  }
};

struct D3Traits {
  using Params = D3Params;
  static constexpr const char* kName = "torchani_fast::dispersion_d3";
  static void save(AutogradContext* ctx, const Params& p) {
    ctx->saved_data["tables"] = std::vector<at::Tensor>{
        p.coeff6, p.coordnums_a, p.coordnums_b, p.covalent_radii, p.sqrt_charge_ab,
        p.cutoff_radii};
    ctx->saved_data["constants"] =
        std::vector<double>{p.s6, p.s8, p.a1, p.a2, p.k1, p.k2, p.k3, p.eps};
    save_pair_cutoff(ctx, p.angstrom_to_bohr, p.cut);
  }
  static Params load(AutogradContext* ctx) {
    const auto t = ctx->saved_data["tables"].toTensorVector();
    const auto c = ctx->saved_data["constants"].toDoubleVector();
    return Params{t[0], t[1], t[2], t[3], t[4], t[5], c[0], c[1], c[2], c[3], c[4], c[5],
                  c[6], c[7], ctx->saved_data["a2b"].toDouble(), load_pair_cutoff(ctx)};
  }
  static at::Tensor grad_aten(const at::Tensor& grad, const at::Tensor& elem,
                              const at::Tensor& pairs, const at::Tensor& distances,
                              const c10::optional<at::Tensor>& ghost, bool atomic,
                              const Params& p) {
    return d3_grad_aten(grad, elem, pairs, distances, ghost, atomic, p);
  }
};

template <typename Tr>
std::tuple<at::Tensor, at::Tensor> call_pair_potential(
    const at::Tensor& elem, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost, bool atomic, bool derivatives,
    const typename Tr::Params& p) {
  using Op = PairPotentialOp<typename Tr::Params>;
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(Tr::kName, "").template typed<typename Op::Schema>();
  return Op::call(op, elem, pairs, distances, ghost, atomic, derivatives, p);
}

template <typename Tr>
class PairPotentialFunction : public torch::autograd::Function<PairPotentialFunction<Tr>> {
 public:
  static tensor_list forward(AutogradContext* ctx, const at::Tensor& elem,
                             const at::Tensor& pairs, const at::Tensor& distances,
                             const c10::optional<at::Tensor>& ghost, bool atomic,
                             bool derivatives, const typename Tr::Params& p) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [energies, derivs] = call_pair_potential<Tr>(elem, pairs, distances, ghost, atomic,
                                                      true, p);
    ctx->save_for_backward({elem, pairs, distances, ghost.value_or(at::Tensor())});
    ctx->saved_data["derivs"] = derivs;
    ctx->saved_data["atomic"] = atomic;
    Tr::save(ctx, p);
    // derivs is returned only when asked for (the op's contract), never differentiable;
    // a copy, so that the caller editing it cannot change what the backward reads.
    at::Tensor shown = derivatives ? derivs.clone() : derivs.new_empty({0, derivs.size(1)});
    ctx->mark_non_differentiable({shown});
    return {energies, shown};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    tensor_list out(7);
    if (!ctx->needs_input_grad(2)) return out;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& elem = saved[0];
    const at::Tensor& pairs = saved[1];
    const bool atomic = ctx->saved_data["atomic"].toBool();
    const at::Tensor& grad = grads[0];  // (materialized: zeros when unused)
    if (at::GradMode::is_enabled()) {
      // create_graph=True: a recorded, differentiable gradient.
      const c10::optional<at::Tensor> ghost =
          saved[3].defined() ? c10::optional<at::Tensor>(saved[3]) : c10::nullopt;
      out[2] = Tr::grad_aten(grad, elem, pairs, saved[2], ghost, atomic, Tr::load(ctx));
    } else {
      static const auto op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("torchani_fast::pair_energies_backward", "")
                                 .typed<decltype(pair_energies_backward_cpu)>();
      out[2] = op.call(grad, ctx->saved_data["derivs"].toTensor(), pairs, elem, atomic);
    }
    return out;
  }
};

template <typename Tr>
std::tuple<at::Tensor, at::Tensor> pair_potential_autograd(
    const at::Tensor& elem, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost, bool atomic, bool derivatives,
    const typename Tr::Params& p) {
  if (!(at::GradMode::is_enabled() && distances.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_pair_potential<Tr>(elem, pairs, distances, ghost, atomic, derivatives, p);
  }
  const tensor_list out =
      PairPotentialFunction<Tr>::apply(elem, pairs, distances, ghost, atomic, derivatives, p);
  return {out[0], out[1]};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> repulsion_xtb_autograd(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const RepulsionParams& p) {
  return pair_potential_autograd<RepulsionTraits>(elem_idxs, pairs, distances, ghost_flags,
                                                  atomic, derivatives, p);
}

std::tuple<at::Tensor, at::Tensor> dispersion_d3_autograd(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const D3Params& p) {
  return pair_potential_autograd<D3Traits>(elem_idxs, pairs, distances, ghost_flags, atomic,
                                           derivatives, p);
}

}  // namespace torchani_fast
