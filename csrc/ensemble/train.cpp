// ensemble_train: the fused networks while their weights require grad
// (training), in ATen ops on any device, with their first and second
// derivatives written out instead of recorded op by op.
//
// The values (members, atoms) of every element group in one op. Its backward
// gives the AEV and weight gradients of an energy loss; under
// create_graph=True (forces for a force loss) the AEV gradient is InputGrad,
// whose own backward is the second derivative a force loss needs: for the
// directional derivative s = sum_n grad_n . (v_n . dy_n/dx_n) of the networks
// along the AEV direction v (the adjoint of the AEV gradient), the gradient of
// s with respect to the weights, the AEV and the incoming gradient. That is the
// reverse pass over the networks' forward-mode tangent: per layer, with
// primal h, a = sigma(h) and tangent hd, ad = sigma'(h) hd,
//   dW = a^T P + ad^T T,  db = sum P,  P_below = sigma'(h) (P W^T) + sigma''(h) hd (T W^T),
// where T (the tangent's adjoint) is the first backward's delta, which
// InputGrad keeps, and P (the primal's adjoint) starts at 0 above the last
// layer. Rarer requests (weight gradients under create_graph, third
// derivatives) recompute the networks in differentiable ATen ops and
// differentiate those.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/parallel.h"
#include "ensemble/aten_mlp.h"
#include "ops.h"

namespace torchani_fast {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;
using namespace aten_mlp;

// Flushes denormals on OpenMP's team while a float32 CPU op runs
// (common/parallel.h: TeamFlushDenormals).
bool flushes(const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; }

// One element group: its atoms (rows of the AEV), AEV columns (all of them
// when `all_columns`), layer-1 weights (K, members*d1) and the later packs
// b1 (members*d1,), W2 (members, d1, d2), b2 (members, 1, d2), ...
struct Group {
  at::Tensor atoms, cols, w1;
  bool all_columns;
  std::vector<at::Tensor> packs;
  int64_t layers;

  // Its rows and columns of an (atoms, features) tensor: on the CPU outside
  // grad mode in one pass (each row's columns picked as it is copied: the
  // 2iuz batch's 1472 x 1008 AEV is not copied whole first), otherwise (a
  // recording for third derivatives, another device) by two index_selects.
  at::Tensor gather(const at::Tensor& t) const {
    if (t.is_cpu() && atoms.is_cpu() && !at::GradMode::is_enabled() && t.dim() == 2)
      return gather_cpu(t);
    const at::Tensor rows = t.index_select(0, atoms);
    return all_columns ? rows : rows.index_select(1, cols);
  }
  // (atoms and columns checked by ensemble_train: check_rows_and_columns.)
  at::Tensor gather_cpu(const at::Tensor& t) const {
    const at::Tensor src = t.contiguous(), a = atoms.contiguous(), c = cols.contiguous();
    const int64_t n = a.numel(), features = src.size(1);
    const int64_t K = all_columns ? features : c.numel();
    const int64_t* ap = a.data_ptr<int64_t>();
    const int64_t* cp = c.data_ptr<int64_t>();
    at::Tensor out = at::empty({n, K}, src.options());
    AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "ensemble_train_gather", [&] {
      const scalar_t* in = src.data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      torchani_fast::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const scalar_t* row = in + ap[i] * features;
          scalar_t* dst = o + i * K;
          if (all_columns) {
            std::copy(row, row + features, dst);
          } else {
            for (int64_t j = 0; j < K; ++j) dst[j] = row[cp[j]];
          }
        }
      });
    });
    return out;
  }
  // Set this group's rows and columns of `into` (atoms, features; from
  // scatter_target) to `val`, and the rest of its rows to 0: on the CPU one
  // pass over each row, elsewhere through a zeroed (n, features) copy.
  void scatter_into(at::Tensor& into, const at::Tensor& val) const {
    if (all_columns) {
      into.index_copy_(0, atoms, val);
      return;
    }
    if (!(into.is_cpu() && into.is_contiguous())) {
      into.index_copy_(0, atoms, val.new_zeros({val.size(0), into.size(1)}).index_copy_(1, cols, val));
      return;
    }
    const at::Tensor v = val.contiguous(), a = atoms.contiguous(), c = cols.contiguous();
    const int64_t features = into.size(1), used = c.numel();
    AT_DISPATCH_FLOATING_TYPES(into.scalar_type(), "ensemble_train_scatter", [&] {
      scalar_t* out = into.data_ptr<scalar_t>();
      const scalar_t* src = v.data_ptr<scalar_t>();
      const int64_t* rows = a.data_ptr<int64_t>();
      const int64_t* columns = c.data_ptr<int64_t>();
      torchani_fast::parallel_for(0, v.size(0), 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          scalar_t* dst = out + rows[r] * features;
          const scalar_t* row = src + r * used;
          std::fill(dst, dst + features, scalar_t(0));
          for (int64_t j = 0; j < used; ++j) dst[columns[j]] = row[j];
        }
      });
    });
  }
  const at::Tensor& weight(int64_t t) const { return packs[2 * t - 1]; }  // W_{t+1}, (k, d_t, d_{t+1})
};

// The (rows, features) AEV gradient that the groups' scatter_into fill. On the
// CPU it is not zeroed first: scatter_into writes its groups' rows whole and
// the rows no group has are zeroed here, one pass over the output instead of
// two (1-member ch4 force steps ~3% faster); the atoms are distinct rows
// (check_rows_and_columns: a row written twice would keep only the last
// group's columns). Elsewhere zeros.
at::Tensor scatter_target(const at::TensorOptions& options, int64_t rows, int64_t features,
                          const std::vector<Group>& groups) {
  if (!options.device().is_cpu()) return at::zeros({rows, features}, options);
  at::Tensor out = at::empty({rows, features}, options);
  std::vector<uint8_t> covered(static_cast<size_t>(rows), 0);
  for (const Group& g : groups) {
    const at::Tensor a = g.atoms.contiguous();
    const int64_t* ap = a.data_ptr<int64_t>();
    for (int64_t i = 0; i < a.numel(); ++i) covered[ap[i]] = 1;
  }
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "ensemble_train_zero_rows", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r)
      if (!covered[r]) std::fill(o + r * features, o + (r + 1) * features, scalar_t(0));
  });
  return out;
}

// The CPU paths index the AEV with the atoms and columns themselves
// (Group::gather_cpu, scatter_into, scatter_target), so ensemble_train checks
// them once: the atoms distinct rows of the AEV, each group's columns columns
// of it. (Other devices index with ATen ops, which check.)
void check_rows_and_columns(const at::Tensor& atoms, at::TensorList columns, int64_t rows,
                            int64_t features) {
  if (!atoms.is_cpu()) return;
  const at::Tensor a = atoms.contiguous();
  const int64_t* ap = a.data_ptr<int64_t>();
  std::vector<uint8_t> seen(static_cast<size_t>(rows), 0);
  for (int64_t i = 0; i < a.numel(); ++i) {
    TORCH_CHECK(ap[i] >= 0 && ap[i] < rows, "ensemble_train: atom ", ap[i],
                " is not a row of the AEV (", rows, " rows)");
    TORCH_CHECK(!seen[ap[i]], "ensemble_train: atoms must be distinct rows of the AEV (in [0, ",
                rows, ")); atom ", ap[i], " is repeated");
    seen[ap[i]] = 1;
  }
  for (const at::Tensor& c : columns) {
    if (!c.is_cpu()) continue;
    const at::Tensor cc = c.contiguous();
    const int64_t* cp = cc.data_ptr<int64_t>();
    for (int64_t j = 0; j < cc.numel(); ++j)
      TORCH_CHECK(cp[j] >= 0 && cp[j] < features, "ensemble_train: column ", cp[j],
                  " is not a column of the AEV (", features, " features)");
  }
}

std::vector<Group> make_groups(const at::Tensor& atoms, at::IntArrayRef sizes,
                               at::TensorList columns, at::TensorList first, at::TensorList packs,
                               at::IntArrayRef layers, int64_t features) {
  std::vector<Group> groups;
  int64_t row = 0, pack = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    Group group;
    group.atoms = atoms.narrow(0, row, sizes[g]);
    group.cols = columns[g];
    group.all_columns = columns[g].numel() == features;
    group.w1 = first[g];
    group.layers = layers[g];
    group.packs.assign(packs.begin() + pack, packs.begin() + pack + 2 * layers[g] - 1);
    groups.push_back(std::move(group));
    row += sizes[g];
    pack += 2 * layers[g] - 1;
  }
  return groups;
}

// What both Functions saved, unpacked: a leading tensor (the AEV or the
// incoming gradient), the layer-1 weights, the packs, then `lists` lists of one
// tensor per hidden transition of every group, then the rest; and the
// arguments kept in saved_data.
struct Saved {
  std::vector<at::Tensor> all, first, packs, rest;
  std::vector<std::vector<at::Tensor>> lists;
  std::vector<int64_t> sizes, layers;
  std::vector<at::Tensor> columns;
  at::Tensor atoms;
  int64_t members, activation, nf, np = 0, nh = 0;

  Saved(AutogradContext* ctx, int lists_count) : all(ctx->get_saved_variables()) {
    sizes = ctx->saved_data["sizes"].toIntVector();
    layers = ctx->saved_data["layers"].toIntVector();
    columns = ctx->saved_data["columns"].toTensorVector();
    atoms = ctx->saved_data["atoms"].toTensor();
    members = ctx->saved_data["members"].toInt();
    activation = ctx->saved_data["activation"].toInt();
    nf = static_cast<int64_t>(sizes.size());
    for (int64_t l : layers) {
      np += 2 * l - 1;
      nh += l - 1;
    }
    first.assign(all.begin() + 1, all.begin() + 1 + nf);
    packs.assign(all.begin() + 1 + nf, all.begin() + 1 + nf + np);
    auto at = all.begin() + 1 + nf + np;
    for (int i = 0; i < lists_count; ++i, at += nh) lists.emplace_back(at, at + nh);
    rest.assign(at, all.end());
  }
  // What the forwards save, in this layout (the last of `tensors` may be the rest).
  static void save(AutogradContext* ctx, const at::Tensor& lead, at::TensorList first,
                   at::TensorList packs, std::initializer_list<const std::vector<at::Tensor>*> tensors,
                   const at::Tensor& atoms, const std::vector<int64_t>& sizes,
                   const std::vector<at::Tensor>& columns, const std::vector<int64_t>& layers,
                   int64_t members, int64_t activation) {
    // Intermediates too are saved variables, not saved_data: the engine frees
    // them once the node's backward ran (unless retain_graph), as it does
    // autograd's own; outputs among them are saved without a reference cycle.
    std::vector<at::Tensor> saved{lead};
    saved.insert(saved.end(), first.begin(), first.end());
    saved.insert(saved.end(), packs.begin(), packs.end());
    for (const auto* list : tensors) saved.insert(saved.end(), list->begin(), list->end());
    ctx->save_for_backward(saved);
    ctx->saved_data["atoms"] = atoms;
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["columns"] = columns;
    ctx->saved_data["layers"] = layers;
    ctx->saved_data["members"] = members;
    ctx->saved_data["activation"] = activation;
  }
  const at::Tensor& lead() const { return all[0]; }
  // The leading tensor, the weights and the first `count` lists.
  std::vector<at::Tensor> prefix(int count) const {
    return std::vector<at::Tensor>(all.begin(), all.begin() + 1 + nf + np + count * nh);
  }
  std::vector<Group> groups(int64_t features) const {
    return make_groups(atoms, sizes, columns, first, packs, layers, features);
  }
};

// A group's values (members, n) at its inputs x (n, K_g) in differentiable ATen
// ops (the same ops as the forward); with `pre`/`post`, its pre-activations and
// activations are appended.
at::Tensor group_values(const Group& g, const at::Tensor& x, int64_t members, int64_t small,
                        int64_t activation, std::vector<at::Tensor>* pre,
                        std::vector<at::Tensor>* post) {
  at::Tensor h = first_layer(x, g.w1, g.packs[0], members, small);
  for (int64_t t = 1; t < g.layers; ++t) {
    const at::Tensor a = activation_forward(h, activation);
    if (pre != nullptr) {
      pre->push_back(h);
      post->push_back(a);
    }
    h = at::baddbmm(g.packs[2 * t], a, g.weight(t));
  }
  return h.reshape({members, -1});
}

// The gradients of `outputs` (with `grads`) with respect to the tensors of
// `inputs` for which `needed`, by autograd, differentiable (create_graph):
// undefined where not needed or unused.
std::vector<at::Tensor> recorded_grads(const std::vector<at::Tensor>& outputs,
                                       const std::vector<at::Tensor>& grads,
                                       const std::vector<at::Tensor>& inputs,
                                       const std::vector<bool>& needed) {
  std::vector<at::Tensor> wanted;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (needed[i]) wanted.push_back(inputs[i]);
  std::vector<at::Tensor> result(inputs.size());
  if (wanted.empty() || outputs.empty()) return result;
  const auto got = torch::autograd::grad(outputs, wanted, grads, /*retain_graph=*/true,
                                         /*create_graph=*/true, /*allow_unused=*/true);
  for (size_t i = 0, j = 0; i < inputs.size(); ++i)
    if (needed[i]) result[i] = got[j++];
  return result;
}

// A group's AEV gradient (n, K) of sum(grad_g * values) from its pre-activations
// `pre` (h_1 .. h_{L-1}), in differentiable ATen ops (third derivatives).
at::Tensor input_grad_from(const Group& g, const at::Tensor& grad_g, const std::vector<at::Tensor>& pre,
                           int64_t activation) {
  at::Tensor delta = grad_g.unsqueeze(2);
  for (int64_t t = g.layers - 1; t >= 1; --t)
    delta = activation_backward(at::bmm(delta, g.weight(t).transpose(1, 2)), pre[t - 1], activation);
  return delta.transpose(0, 1).reshape({delta.size(1), -1}).mm(g.w1.t());
}

// The AEV gradient (atoms, features) of sum(grad * values) of ensemble_train's
// groups, as a function of grad, the weights and the pre-activations h_t that
// TrainFunction returns besides the values (so that the engine adds this
// node's gradient for them to the energy loss's before TrainFunction's backward
// runs once for both: one weight-gradient product per layer, not two).
class InputGrad : public torch::autograd::Function<InputGrad> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& atoms,
                            std::vector<int64_t> sizes, std::vector<at::Tensor> columns,
                            at::TensorList first, at::TensorList packs, at::TensorList pre,
                            std::vector<int64_t> layers, int64_t members, int64_t activation,
                            int64_t features) {
    ctx->set_materialize_grads(false);
    const TeamFlushDenormals flush(flushes(grad));
    const auto groups = make_groups(atoms, sizes, columns, first, packs, layers, features);
    at::Tensor result = scatter_target(grad.options(), grad.size(1), features, groups);
    std::vector<at::Tensor> above, deltas;  // per transition t: delta_{t+1} W^T, delta_t
    int64_t at_t = 0;
    for (const Group& g : groups) {
      at::Tensor delta = grad.index_select(1, g.atoms).unsqueeze(2);  // (k, n, 1)
      std::vector<at::Tensor> g_above(g.layers - 1), g_deltas(g.layers - 1);
      for (int64_t t = g.layers - 1; t >= 1; --t) {
        g_above[t - 1] = at::bmm(delta, g.weight(t).transpose(1, 2));
        delta = activation_backward(g_above[t - 1], pre[at_t + t - 1], activation);
        g_deltas[t - 1] = delta;
      }
      g.scatter_into(result, delta.transpose(0, 1).reshape({delta.size(1), -1}).mm(g.w1.t()));
      above.insert(above.end(), g_above.begin(), g_above.end());
      deltas.insert(deltas.end(), g_deltas.begin(), g_deltas.end());
      at_t += g.layers - 1;
    }
    const std::vector<at::Tensor> pre_list(pre.begin(), pre.end());
    Saved::save(ctx, grad, first, packs, {&pre_list, &above, &deltas}, atoms, sizes, columns,
                layers, members, activation);
    ctx->saved_data["features"] = features;
    return result;
  }

  // For v, the adjoint of the AEV gradient: the derivatives of
  // s = sum grad . (v . dvalues/daev) with respect to grad (the tangent's
  // output), the weights (the products with the tangent, ad^T delta) and each
  // pre-activation (sigma''(h) hd delta_above W^T; the primal path's own
  // products are TrainFunction's).
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const Saved sv(ctx, 3);  // lists: pre, above, deltas
    const int64_t members = sv.members, activation = sv.activation;
    const int64_t nf = sv.nf, np = sv.np, nh = sv.nh;
    const at::Tensor& grad = sv.lead();
    const std::vector<at::Tensor>& pre = sv.lists[0];
    const std::vector<at::Tensor>& above = sv.lists[1];
    const std::vector<at::Tensor>& deltas = sv.lists[2];
    const std::vector<at::Tensor> inputs = sv.prefix(1);  // grad, first, packs, pre
    const auto groups = sv.groups(ctx->saved_data["features"].toInt());
    // Output edges: grad 0, atoms 1, first 2.., packs, pre.
    std::vector<bool> needed{ctx->needs_input_grad(0)};
    for (int64_t i = 0; i < nf + np + nh; ++i) needed.push_back(ctx->needs_input_grad(2 + i));
    const at::Tensor v = grads[0];  // (atoms, features)
    std::vector<at::Tensor> result(needed.size());  // grad, first..., packs..., pre...
    if (!v.defined()) return pack_outputs(result, nf, np, nh);
    const TeamFlushDenormals flush(flushes(v));
    if (at::GradMode::is_enabled()) {  // a third derivative: differentiate a recording
      std::vector<at::Tensor> outs, gs;
      int64_t at_t = 0;
      for (const Group& g : groups) {
        const std::vector<at::Tensor> g_pre(pre.begin() + at_t, pre.begin() + at_t + g.layers - 1);
        outs.push_back(input_grad_from(g, grad.index_select(1, g.atoms), g_pre, activation));
        gs.push_back(g.gather(v));
        at_t += g.layers - 1;
      }
      result = recorded_grads(outs, gs, inputs, needed);
      return pack_outputs(result, nf, np, nh);
    }
    if (needed[0]) result[0] = at::zeros_like(grad);
    int64_t at_t = 0, at_p = 1 + nf;
    const int64_t at_h = 1 + nf + np;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const Group& g = groups[gi];
      const int64_t L = g.layers, n = g.atoms.size(0);
      const at::Tensor vg = g.gather(v);
      const at::Tensor grad_y = grad.index_select(1, g.atoms).unsqueeze(2);  // (k, n, 1)
      // The tangent along v: hd_t = d h_t, ad_t = sigma'(h_t) hd_t.
      at::Tensor hd = vg.mm(g.w1).view({n, members, -1}).transpose(0, 1);
      for (int64_t t = 1; t < L; ++t) {
        const at::Tensor& h = pre[at_t + t - 1];
        const at::Tensor ad = activation_backward(hd, h, activation);
        if (needed[at_h + at_t + t - 1]) {
          result[at_h + at_t + t - 1] =
              activation_second_along(above[at_t + t - 1], hd, ad, h, activation);
        }
        const at::Tensor& delta_above = t == L - 1 ? grad_y : deltas[at_t + t];
        if (needed[at_p + 2 * t - 1]) result[at_p + 2 * t - 1] = at::bmm(ad.transpose(1, 2), delta_above);
        hd = at::bmm(ad, g.weight(t));
      }
      if (needed[0]) result[0].index_copy_(1, g.atoms, hd.reshape({members, n}));
      if (needed[1 + gi]) {  // delta_1: the incoming gradient itself for a single layer
        const at::Tensor& delta1 = L == 1 ? grad_y : deltas[at_t];
        result[1 + gi] = vg.t().mm(delta1.transpose(0, 1).reshape({n, -1}));
      }
      at_t += L - 1;
      at_p += 2 * L - 1;
    }
    return pack_outputs(result, nf, np, nh);
  }

 private:
  static tensor_list pack_outputs(const std::vector<at::Tensor>& result, int64_t nf, int64_t np,
                                  int64_t nh) {
    // grad, atoms, sizes, columns, first, packs, pre, layers, members, activation, features
    tensor_list out(8 + nf + np + nh);
    out[0] = result[0];
    for (int64_t i = 0; i < nf + np + nh; ++i) out[4 + i] = result[1 + i];
    return out;
  }
};

// The networks' values (members, atoms) of every group (atoms outside the
// groups 0), followed by the groups' pre-activations h_t (members, n, d_t),
// which InputGrad differentiates.
class TrainFunction : public torch::autograd::Function<TrainFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const at::Tensor& aev, const at::Tensor& atoms,
                             std::vector<int64_t> sizes, std::vector<at::Tensor> columns,
                             at::TensorList first, at::TensorList packs,
                             std::vector<int64_t> layers, int64_t members, int64_t small,
                             int64_t activation) {
    // Outputs without a gradient arrive undefined, not as zeros: the
    // pre-activations have one only under a force loss.
    ctx->set_materialize_grads(false);
    const TeamFlushDenormals flush(flushes(aev));
    const auto groups = make_groups(atoms, sizes, columns, first, packs, layers, aev.size(1));
    // Each group's inputs, kept for the layer-1 weight gradient.
    std::vector<at::Tensor> inputs, pre, post, values;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const Group& g = groups[gi];
      inputs.push_back(g.gather(aev));
      values.push_back(group_values(g, inputs.back(), members, small, activation, &pre, &post));
    }
    at::Tensor out = at::zeros({members, aev.size(0)}, aev.options());
    if (!values.empty()) out.index_copy_(1, atoms, at::cat(values, 1));
    Saved::save(ctx, aev, first, packs, {&pre, &post, &inputs}, atoms, sizes, columns, layers,
                members, activation);
    ctx->saved_data["small"] = small;
    tensor_list outputs{out};
    outputs.insert(outputs.end(), pre.begin(), pre.end());
    return outputs;
  }

  // grads: the values' (energy loss) and, under a force loss, the
  // pre-activations' (from InputGrad's backward), added by the engine: one
  // pass back through the networks for both.
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const Saved sv(ctx, 2);  // lists: pre, post; the rest: each group's inputs
    const int64_t members = sv.members, activation = sv.activation;
    const int64_t small = ctx->saved_data["small"].toInt();
    const int64_t nf = sv.nf, np = sv.np;
    const at::Tensor& aev = sv.lead();
    const at::Tensor& atoms = sv.atoms;
    const std::vector<at::Tensor>& pre = sv.lists[0];
    const std::vector<at::Tensor>& post = sv.lists[1];
    const std::vector<at::Tensor>& inputs = sv.rest;
    const std::vector<at::Tensor> differentiable = sv.prefix(0);  // aev, first, packs
    // Output edges: aev 0, atoms 1, first 2.., packs 2+nf..
    std::vector<bool> needed{ctx->needs_input_grad(0)};
    bool any_weight = false;
    for (int64_t i = 0; i < nf + np; ++i) {
      needed.push_back(ctx->needs_input_grad(2 + i));
      any_weight = any_weight || needed.back();
    }
    const at::Tensor grad = grads[0].defined() ? grads[0] : at::zeros({members, aev.size(0)}, aev.options());
    bool pre_grads = false;
    for (size_t i = 1; i < grads.size(); ++i) pre_grads = pre_grads || grads[i].defined();
    std::vector<at::Tensor> result(needed.size());  // aev, first..., packs...
    const auto groups = sv.groups(aev.size(1));
    const TeamFlushDenormals flush(flushes(aev));
    if (at::GradMode::is_enabled()) {
      // create_graph=True. For forces (the values' gradient only, to the AEV):
      // InputGrad, whose second derivative is written out. Anything else
      // (weight gradients, gradients of the pre-activations: a third
      // derivative) differentiates a recorded recomputation.
      std::vector<bool> rest(needed);
      if (needed[0] && !pre_grads) {
        result[0] = InputGrad::apply(grad, atoms, sv.sizes, sv.columns, at::TensorList(sv.first),
                                     at::TensorList(sv.packs), at::TensorList(pre), sv.layers,
                                     members, activation, aev.size(1));
        rest[0] = false;
      }
      if (any_weight || rest[0]) {
        std::vector<at::Tensor> outs, gs;
        std::vector<at::Tensor> re_pre, re_post;
        for (const Group& g : groups) {
          outs.push_back(group_values(g, g.gather(aev), members, small, activation, &re_pre, &re_post));
          gs.push_back(grad.index_select(1, g.atoms));
        }
        for (size_t i = 1; i < grads.size(); ++i) {
          if (!grads[i].defined()) continue;
          outs.push_back(re_pre[i - 1]);
          gs.push_back(grads[i]);
        }
        const auto w = recorded_grads(outs, gs, differentiable, rest);
        for (size_t i = 0; i < result.size(); ++i)
          if (rest[i]) result[i] = w[i];
      }
    } else {
      if (needed[0]) result[0] = scatter_target(aev.options(), aev.size(0), aev.size(1), groups);
      int64_t at_t = 0, at_p = 1 + nf;
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        const Group& g = groups[gi];
        const int64_t L = g.layers, n = g.atoms.size(0);
        at::Tensor delta = grad.index_select(1, g.atoms).unsqueeze(2);  // (k, n, 1)
        for (int64_t t = L - 1; t >= 1; --t) {
          const int64_t w_slot = at_p + 2 * t - 1, b_slot = at_p + 2 * t;
          if (needed[w_slot]) result[w_slot] = at::bmm(post[at_t + t - 1].transpose(1, 2), delta);
          if (needed[b_slot]) result[b_slot] = delta.sum(1, true);
          delta = activation_backward(at::bmm(delta, g.weight(t).transpose(1, 2)),
                                      pre[at_t + t - 1], activation);
          if (grads[1 + at_t + t - 1].defined()) delta = delta + grads[1 + at_t + t - 1];
        }
        const at::Tensor d = delta.transpose(0, 1).reshape({n, -1});
        if (needed[1 + gi]) result[1 + gi] = inputs[gi].t().mm(d);
        if (needed[at_p]) result[at_p] = d.sum(0);
        if (needed[0]) g.scatter_into(result[0], d.mm(g.w1.t()));
        at_t += L - 1;
        at_p += 2 * L - 1;
      }
    }
    tensor_list out(8 + nf + np);  // aev, atoms, sizes, columns, first, packs, 4 more
    out[0] = result[0];
    for (int64_t i = 0; i < nf + np; ++i) out[4 + i] = result[1 + i];
    return out;
  }
};

}  // namespace

at::Tensor ensemble_train(const at::Tensor& aev, const at::Tensor& atoms, at::IntArrayRef sizes,
                          at::TensorList columns, at::TensorList first, at::TensorList packs,
                          at::IntArrayRef layers, int64_t members, int64_t small,
                          int64_t activation) {
  TORCH_CHECK(aev.dim() == 2 && aev.is_floating_point(),
              "ensemble_train: aev must be a 2-D floating-point tensor (atoms, features), got ",
              aev.sizes(), " ", aev.scalar_type());
  TORCH_CHECK(atoms.dim() == 1 && atoms.scalar_type() == at::kLong,
              "ensemble_train: atoms must be a 1-D int64 tensor, got ", atoms.sizes(), " ",
              atoms.scalar_type());
  TORCH_CHECK(members >= 1, "ensemble_train: members must be at least 1, got ", members);
  TORCH_CHECK(activation == 0 || activation == kActivationGelu,
              "ensemble_train: activation must be 0 (CELU) or 1 (GELU), got ", activation);
  const size_t groups = sizes.size();
  TORCH_CHECK(columns.size() == groups && first.size() == groups && layers.size() == groups,
              "ensemble_train: sizes, columns, first and layers need one entry per group, got ",
              groups, ", ", columns.size(), ", ", first.size(), " and ", layers.size());
  int64_t rows = 0, expected_packs = 0;
  for (size_t g = 0; g < groups; ++g) {
    TORCH_CHECK(sizes[g] >= 0, "ensemble_train: sizes[", g, "] = ", sizes[g], " is negative");
    TORCH_CHECK(layers[g] >= 1, "ensemble_train: layers[", g, "] = ", layers[g],
                " is not a number of layers");
    TORCH_CHECK(columns[g].dim() == 1 && columns[g].scalar_type() == at::kLong,
                "ensemble_train: columns[", g, "] must be a 1-D int64 tensor, got ",
                columns[g].sizes(), " ", columns[g].scalar_type());
    TORCH_CHECK(first[g].dim() == 2 && first[g].size(0) == columns[g].numel(),
                "ensemble_train: first[", g, "] must be (", columns[g].numel(),
                ", members * d1) for its columns, got ", first[g].sizes());
    rows += sizes[g];
    expected_packs += 2 * layers[g] - 1;
  }
  TORCH_CHECK(rows == atoms.numel(), "ensemble_train: the sizes add up to ", rows,
              " atoms, but atoms has ", atoms.numel());
  TORCH_CHECK(static_cast<int64_t>(packs.size()) == expected_packs, "ensemble_train: layers ",
              layers, " need ", expected_packs, " packs, got ", packs.size());
  check_rows_and_columns(atoms, columns, aev.size(0), aev.size(1));
  return TrainFunction::apply(aev, atoms, sizes.vec(), columns.vec(), first, packs, layers.vec(),
                              members, small, activation)[0];
}

}  // namespace torchani_fast
