// Declarations of every torchani_fast kernel. Schemas live in schemas.h.
//
// Data flow of one energy + forces evaluation (M molecules, A atoms each,
// N = M*A flattened atoms, P neighbour pairs):
//
//   species (M,A), coords (M,A,3), cell (3,3)?, pbc (3,)?
//        |
//        |  neighbor_pairs  (no gradient: integer output)
//        v
//   pairs (2,P) int64 into the flattened atoms, images (P,3) integer lattice
//   translations stored in the coordinate dtype
//        |
//        |  pair_vectors: diff = coords[pairs[0]] - coords[pairs[1]] + images @ cell
//        |  and |diff| (CPU; ATen elsewhere), differentiable w.r.t. coords AND
//        |  cell, which is what ASE stress needs
//        v
//   diff_vectors (P,3)  --- aev_forward --->  aev (M,A,F)
//
// Backward (forces):   grad_aev (M,A,F) --- aev_backward ---> grad_diff (P,3)
// and pair_vectors' backward carries grad_diff back to coords and cell.
//
// Double backward (Hessians, force training) differentiates aev_backward with
// respect to grad_aev and diff_vectors; aev_backward is an op of its own so that
// this can be registered without touching the first derivative:
//   d/d grad_aev: grad_grad_diff (P,3) --- aev_jvp ---> (M,A,F)
//   d/d diff:     grad_aev, grad_grad_diff --- aev_double_backward ---> (P,3)
//
// TorchANI conventions reproduced here (see torchani/aev/_terms.py):
//   radial  term  0.25 * exp(-eta (r - Rs)^2) * fc(r)                   (the 0.25)
//   angular term  2 * ((1 + cos(acos(0.95 cos t) - ts)) / 2)^zeta
//                   * exp(-eta ((r1 + r2)/2 - Rs)^2) * fc(r1) fc(r2)    (the 0.95)
//   fc(r) = 0.5 cos(pi r / Rc) + 0.5 (cutoff_kind 0) or exp(1 - 1 / max(eps,
//   1 - (r/Rc)^order)) (cutoff_kind 1, TorchANI's CutoffSmooth); pairs with
//   r > Rc contribute nothing.
//   Layout: radial block s*R + k for neighbour species s; angular block
//   S*R + p*(A*Z) + a*Z + z for the upper-triangular species pair p.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace torchani_fast {

// Pairs of atoms closer than `cutoff`, each unordered pair (and each periodic
// image) once. Padding atoms (species < 0) never appear. `cell_list` selects
// binning (O(N)); otherwise every pair of atoms of a molecule is tested.
std::tuple<at::Tensor, at::Tensor> neighbor_pairs_cpu(
    const at::Tensor& species, const at::Tensor& coords,
    const c10::optional<at::Tensor>& cell, const c10::optional<at::Tensor>& pbc,
    double cutoff, bool cell_list);

// The pairs' difference vectors (P, 3), coords[pairs[0]] - coords[pairs[1]]
// (+ images @ cell when a cell is given), and their lengths (P,). coords is
// (N, 3); entries of pairs must be in [0, N). pair_vectors_backward is the part
// of its first derivative that ATen does slowly, the scatter of the vectors'
// gradient grad (P, 3) to the coordinates (N = num_atoms, 3), in pair order;
// the autograd kernel adds the lengths' share to grad and forms the cell's
// gradient, images^T grad. Not differentiable itself.
std::tuple<at::Tensor, at::Tensor> pair_vectors_cpu(const at::Tensor& coords,
                                                    const at::Tensor& pairs,
                                                    const c10::optional<at::Tensor>& images,
                                                    const c10::optional<at::Tensor>& cell);
at::Tensor pair_vectors_backward_cpu(const at::Tensor& grad, const at::Tensor& pairs,
                                     int64_t num_atoms);

// Argument checks of both neighbour ops (shapes and dtypes only; no data is read).
void check_neighbor_inputs(const char* op, const at::Tensor& species, const at::Tensor& coords,
                           const c10::optional<at::Tensor>& cell,
                           const c10::optional<at::Tensor>& pbc, double cutoff);

// Fixed-capacity variant: pairs (2, max_pairs) padded with -1, images
// (max_pairs, 3) padded with 0, and num_pairs, a 0-dim int64 tensor with the
// number of pairs that exist (> max_pairs means the list overflowed and the
// pairs beyond the capacity were dropped). Output shapes depend only on input
// shapes and on CUDA nothing is read back, so a CUDA graph can capture it.
// Errors: the CPU raises; CUDA cannot without a sync, so num_pairs = -1 means
// non-finite coordinates, -2 a singular cell and -3 a cell too small for the
// cutoff (neighbors::kMaxVisits; no pairs are returned).
std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_cpu(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs);

#ifdef TORCHANI_FAST_CUDA
// CUDA kernels (neighbors/neighbors_cuda.cu, aev/cuda/aev_cuda.cu): same semantics as the CPU
// ones, except that data-dependent errors are not raised by the ops that must
// not synchronise (see the files' headers). neighbor_pairs_cuda reads the pair
// count back to size its outputs: its one host synchronisation.
std::tuple<at::Tensor, at::Tensor> neighbor_pairs_cuda(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list);
std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_cuda(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs);
// pair_vectors(_backward) on the device (neighbors/pair_vectors_cuda.cu): the
// CPU kernels' arithmetic, and a gather without float atomics (the same bits
// on every run). The pairs are not read back: (-1, -1) is padding (zero
// vector, no gradient), any other index outside [0, N) gives NaN.
std::tuple<at::Tensor, at::Tensor> pair_vectors_cuda(const at::Tensor& coords,
                                                     const at::Tensor& pairs,
                                                     const c10::optional<at::Tensor>& images,
                                                     const c10::optional<at::Tensor>& cell);
at::Tensor pair_vectors_backward_cuda(const at::Tensor& grad, const at::Tensor& pairs,
                                      int64_t num_atoms);
#endif

// AEV constants in one struct: every tensor is 1-D on the device of the call.
struct AEVParams {
  at::Tensor radial_eta, radial_shifts, angular_eta, angular_zeta, angular_shifts,
      angular_sections;
  double radial_cutoff, angular_cutoff;
  int64_t num_species;
  // The cutoff function of both terms (aev_math::CutoffFn): kind 0 cosine,
  // 1 smooth exp(1 - 1 / max(eps, 1 - (r/rc)^order)); order and eps are read
  // for the smooth kind only. Checked by check_cutoff_fn.
  int64_t cutoff_kind = 0, cutoff_order = 2;
  double cutoff_eps = 1e-10;
};

// Raises naming the argument unless (kind, order, eps) is a supported cutoff.
void check_cutoff_fn(const char* op, int64_t cutoff_kind, int64_t cutoff_order,
                     double cutoff_eps);

// The AEV ops' schemas spell the AEVParams fields out after species, pairs and
// diff_vectors, themselves after the op's own leading tensors (Lead: none,
// grad_aev, ...). AevOp<R, Lead...>::flat<kernel> is `kernel`, which takes an
// AEVParams, with that flat signature: what registration expects.
template <typename R, typename... Lead>
struct AevOp {
  using Kernel = R (*)(Lead..., const at::Tensor& species, const at::Tensor& pairs,
                       const at::Tensor& diff_vectors, const AEVParams& p);
  template <Kernel kernel>
  static R flat(Lead... lead, const at::Tensor& species, const at::Tensor& pairs,
                const at::Tensor& diff_vectors, const at::Tensor& radial_eta,
                const at::Tensor& radial_shifts, const at::Tensor& angular_eta,
                const at::Tensor& angular_zeta, const at::Tensor& angular_shifts,
                const at::Tensor& angular_sections, double radial_cutoff, double angular_cutoff,
                int64_t num_species, int64_t cutoff_kind, int64_t cutoff_order,
                double cutoff_eps) {
    return kernel(lead..., species, pairs, diff_vectors,
                  AEVParams{radial_eta, radial_shifts, angular_eta, angular_zeta, angular_shifts,
                            angular_sections, radial_cutoff, angular_cutoff, num_species,
                            cutoff_kind, cutoff_order, cutoff_eps});
  }
  // The flat signature, for typed dispatcher calls.
  using Schema = R(Lead..., const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, double, double, int64_t, int64_t,
                   int64_t, double);
};
using TensorRef = const at::Tensor&;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
// One alias per AEV op schema (its return type and leading tensors).
using AevForwardOp = AevOp<at::Tensor>;                                   // aev
using AevBackwardOp = AevOp<at::Tensor, TensorRef>;                       // aev_backward, aev_jvp
using AevDoubleBackwardOp = AevOp<at::Tensor, TensorRef, TensorRef>;      // aev_double_backward
using AevLocalDerivativesOp = AevOp<Tensor3, TensorRef, TensorRef>;       // aev_local_derivatives
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using AevWithEdgesOp = AevOp<Tensor2>;                                    // aev_with_edges
using AevBackwardEdgesOp = AevOp<at::Tensor, TensorRef, TensorRef>;       // aev_backward_edges

at::Tensor aev_forward_cpu(const at::Tensor& species, const at::Tensor& pairs,
                           const at::Tensor& diff_vectors, const AEVParams& p);
at::Tensor aev_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const AEVParams& p);

// What the backward needs from its forward, passed explicitly: aev_with_edges
// is aev plus a handle (a (0,) uint8 tensor) that owns the forward's half
// edges, or an empty tensor where they are not kept (other devices, inference
// tensors, more than 64 MB); aev_backward_edges is aev_backward, reading the
// half edges from such a handle when it was built from these very inputs and
// building them otherwise. The Autograd kernel of aev uses the pair (it saves
// the handle in its context); the results are those of aev and aev_backward,
// bit for bit.
std::tuple<at::Tensor, at::Tensor> aev_with_edges_cpu(const at::Tensor& species,
                                                      const at::Tensor& pairs,
                                                      const at::Tensor& diff_vectors,
                                                      const AEVParams& p);
at::Tensor aev_backward_edges_cpu(const at::Tensor& grad_aev, const at::Tensor& edges,
                                  const at::Tensor& species, const at::Tensor& pairs,
                                  const at::Tensor& diff_vectors, const AEVParams& p);

#ifdef TORCHANI_FAST_CUDA
at::Tensor aev_forward_cuda(const at::Tensor& species, const at::Tensor& pairs,
                            const at::Tensor& diff_vectors, const AEVParams& p);
at::Tensor aev_backward_cuda(const at::Tensor& grad_aev, const at::Tensor& species,
                             const at::Tensor& pairs, const at::Tensor& diff_vectors,
                             const AEVParams& p);
// (The CUDA handle owns the warp kernels' per-atom slots, aev/cuda/aev_warp.cuh; the old
// kernels, TORCHANI_FAST_CUDA_AEV=old, keep nothing: an empty handle.)
std::tuple<at::Tensor, at::Tensor> aev_with_edges_cuda(const at::Tensor& species,
                                                       const at::Tensor& pairs,
                                                       const at::Tensor& diff_vectors,
                                                       const AEVParams& p);
at::Tensor aev_backward_edges_cuda(const at::Tensor& grad_aev, const at::Tensor& edges,
                                   const at::Tensor& species, const at::Tensor& pairs,
                                   const at::Tensor& diff_vectors, const AEVParams& p);
#endif

// Second derivatives (aev/second_cpu.cpp; the per-atom math is shared
// with CUDA through aev/second_derivs.h), the two halves of
// aev_backward's own backward:
//   aev_jvp(t)                = J t, J = d aev / d diff: the derivative of
//                               aev_backward w.r.t. grad_aev (force training);
//   aev_double_backward(g, t) = d/d diff <t, aev_backward(g, diff)>
//                             = (sum_f g_f d2 aev_f / d diff2) t (Hessians).
// tangent has the shape of diff_vectors; directions on skipped pairs are ignored.
at::Tensor aev_jvp_cpu(const at::Tensor& tangent, const at::Tensor& species,
                       const at::Tensor& pairs, const at::Tensor& diff_vectors,
                       const AEVParams& p);
at::Tensor aev_double_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                   const at::Tensor& species, const at::Tensor& pairs,
                                   const at::Tensor& diff_vectors, const AEVParams& p);

// Local derivatives for whole Hessians (torchani_fast/grad.py), not differentiable.
// For each centre atom i, over the K "slots" of the atoms its AEV depends on
// (slot 0 = i, then its distinct neighbours; K = the largest count):
//   local_atoms (N, K) int64   flattened atom of each slot, -1 where unused;
//   jacobian    (N, K, 3, C)   d aev_i / d x_slot, AEV columns `columns` (increasing);
//   curvature   (N, K, 3, K, 3) sum_f grad_aev_if d2 aev_if / d x_slot d x_slot'.
std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cpu(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p);

#ifdef TORCHANI_FAST_CUDA
// CUDA versions (aev/cuda/second_cuda.cu), the same math (aev/second_derivs.h), one
// thread per centre atom. aev_jvp_cuda and aev_double_backward_cuda do not
// synchronise (value errors: NaN rows / skipped terms, like aev and
// aev_backward); aev_local_derivatives_cuda reads K back to size its outputs,
// its one synchronisation, and raises like the CPU.
at::Tensor aev_jvp_cuda(const at::Tensor& tangent, const at::Tensor& species,
                        const at::Tensor& pairs, const at::Tensor& diff_vectors,
                        const AEVParams& p);
at::Tensor aev_double_backward_cuda(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                    const at::Tensor& species, const at::Tensor& pairs,
                                    const at::Tensor& diff_vectors, const AEVParams& p);
std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cuda(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p);
#endif

#ifdef TORCHANI_FAST_CUDA
// ensemble_dense (ensemble/ensemble_cuda.cu): every element's network of every
// member for the atoms of aev (N, F), atom n reading element elem_idxs[n] (-1:
// padding, value 0). Per layer l: weights[l] (S, members, d_in, d_out),
// weights_t[l] (S, members, d_out, d_in) (the same, transposed) and biases[l]
// (S, members, d_out), zero-padded to the widest element (layer 1: d_in = F;
// last layer: d_out = 1). Returns atomic (N,), each atom's outputs summed over
// the members in member order, and with input_grad its derivative jacobian
// (N, F) = d atomic / d aev (else (0, F)). Elements outside [-1, S) give NaN
// (no synchronisation). Deterministic; not differentiable itself
// (torchani_fast/ops.py registers its autograd).
std::tuple<at::Tensor, at::Tensor> ensemble_dense_cuda(
    const at::Tensor& aev, const at::Tensor& elem_idxs, at::TensorList weights,
    at::TensorList weights_t, at::TensorList biases, int64_t activation, bool input_grad);
#endif

// Autograd kernels (autograd.cpp): aev differentiates through aev_backward,
// aev_backward through aev_jvp and aev_double_backward; aev_jvp differentiates
// again (through aev_backward and aev_double_backward); aev_double_backward only
// w.r.t. its tangent (third derivatives of the AEV are not implemented).
std::tuple<at::Tensor, at::Tensor> neighbor_pairs_autograd(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list);
std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_autograd(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs);
std::tuple<at::Tensor, at::Tensor> pair_vectors_autograd(const at::Tensor& coords,
                                                         const at::Tensor& pairs,
                                                         const c10::optional<at::Tensor>& images,
                                                         const c10::optional<at::Tensor>& cell);
// The AEV ones take AEVParams; registration gives them the flat schema signature
// (AevOp::flat), and they pass it on flat to autograd.
at::Tensor aev_autograd(const at::Tensor& species, const at::Tensor& pairs,
                        const at::Tensor& diff_vectors, const AEVParams& p);
at::Tensor aev_backward_autograd(const at::Tensor& grad_aev, const at::Tensor& species,
                                 const at::Tensor& pairs, const at::Tensor& diff_vectors,
                                 const AEVParams& p);
at::Tensor aev_backward_edges_autograd(const at::Tensor& grad_aev, const at::Tensor& edges,
                                       const at::Tensor& species, const at::Tensor& pairs,
                                       const at::Tensor& diff_vectors, const AEVParams& p);
at::Tensor aev_jvp_autograd(const at::Tensor& tangent, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const AEVParams& p);
at::Tensor aev_double_backward_autograd(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                        const at::Tensor& species, const at::Tensor& pairs,
                                        const at::Tensor& diff_vectors, const AEVParams& p);
std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_autograd(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff_vectors, const AEVParams& p);

// Fused ensemble networks (ensemble/ensemble_cpu.cpp, CPU only; FusedEnsemble in
// torchani_fast/nn.py). For element groups of atoms (rows `atoms` of `aev`, in
// consecutive runs of `sizes`), group g reading the AEV columns `columns[g]`:
// layer-1 weights first[g] (K_g, members * d1) and, in `packs`, 2 * layers[g] - 1
// tensors: the layer-1 bias (members * d1,), then W_l (members, d_in, d_out) and
// b_l (members, 1, d_out) of the later layers (one output; between layers the
// activation `activation`: 0 CELU(0.1), 1 GELU (exact erf form); layers without
// biases are given zero biases). `panels` is empty or, float32, per group and hidden layer l, W_l as
// (members, d_out/16, d_in, 16) and W_l^T as (members, d_in/16, d_out, 16)
// (ensemble/gemm.h; used on AVX2 CPUs, ignored elsewhere). `atoms` must be distinct.
// Returns values (members, aev.size(0)): each atom's output in its own column,
// 0 for rows of aev in no group (padding); and, if input_grad, the
// flat concatenation over groups of J_g = d(sum over members)/d(used columns),
// (sizes[g], K_g) each; otherwise an empty tensor. Not differentiable itself.
// With the panels, layer 1 skips the 16-column chunks of the AEV that are 0 in
// all rows of a tile of atoms (exact). zero_blocks_exact: the caller vouches
// that such chunks have a zero derivative too (torchani_fast's AEV, whose
// cutoff is not 0 inside the cutoff): J is then 0 there instead of computed.
std::tuple<at::Tensor, at::Tensor> ensemble_mlp_cpu(
    const at::Tensor& aev, const at::Tensor& atoms, at::IntArrayRef sizes,
    at::TensorList columns, at::TensorList first, at::TensorList packs, at::TensorList panels,
    at::IntArrayRef layers, int64_t members, bool input_grad, bool zero_blocks_exact,
    int64_t activation);

// The AEV gradient (atoms, features) of ensemble_mlp's values when every
// member's row of grad_values (members, atoms) is the same at `atoms` (an
// ensemble mean): grad_values[0] * J scattered to the atoms and columns of
// each group. If the rows differ, an empty 1-D tensor (the caller recomputes).
at::Tensor ensemble_mlp_backward_cpu(const at::Tensor& grad_values, const at::Tensor& atoms,
                                     at::IntArrayRef sizes, at::TensorList columns,
                                     const at::Tensor& jacobian, int64_t features);

// ensemble_mlp's values as a differentiable op (w.r.t. aev; the weights are
// constants), for TorchScript models, which cannot call a Python autograd
// Function: the CPU kernel returns the values; the Autograd kernel
// (autograd.cpp) also keeps J when aev requires grad, and its backward is
// ensemble_mlp_backward for the gradient of an ensemble mean, otherwise (other
// incoming gradients, create_graph=True) a recomputation with differentiable
// ATen ops, so that it can be differentiated again.
at::Tensor ensemble_atomic_cpu(const at::Tensor& aev, const at::Tensor& atoms,
                               at::IntArrayRef sizes, at::TensorList columns,
                               at::TensorList first, at::TensorList packs,
                               at::TensorList panels, at::IntArrayRef layers, int64_t members,
                               bool zero_blocks_exact, int64_t activation);
at::Tensor ensemble_atomic_autograd(const at::Tensor& aev, const at::Tensor& atoms,
                                    at::IntArrayRef sizes, at::TensorList columns,
                                    at::TensorList first, at::TensorList packs,
                                    at::TensorList panels, at::IntArrayRef layers,
                                    int64_t members, bool zero_blocks_exact, int64_t activation);

// ensemble_train (ensemble/train.cpp; any device, a CompositeImplicitAutograd
// kernel): the values (members, aev.size(0)) of ensemble_mlp's groups while the
// weights require grad (training). `first` and `packs` as for ensemble_mlp but
// differentiable (nn/training.py's packs: views and cats of the parameters);
// groups of at most `small` atoms take layer 1 as a batched product. Its
// backward gives the AEV and weight gradients; under create_graph=True its AEV
// gradient has the force loss's second derivatives written out.
at::Tensor ensemble_train(const at::Tensor& aev, const at::Tensor& atoms, at::IntArrayRef sizes,
                          at::TensorList columns, at::TensorList first, at::TensorList packs,
                          at::IntArrayRef layers, int64_t members, int64_t small,
                          int64_t activation);

// ensemble_energies: ensemble_atomic's values reduced to energies
// (molecules,): summed over each molecule's atoms (aev holds molecules x atoms
// rows) and over the members, divided by `divisor` (the number of active
// members, TorchANI's mean). One op and one autograd node instead of four
// (autograd.cpp: its backward is grad / divisor * J, or the recomputation).
void check_energies_args(const at::Tensor& aev, int64_t molecules, int64_t divisor);
at::Tensor energies_from_values(const at::Tensor& values, int64_t molecules, int64_t divisor);
at::Tensor ensemble_energies_cpu(const at::Tensor& aev, const at::Tensor& atoms,
                                 at::IntArrayRef sizes, at::TensorList columns,
                                 at::TensorList first, at::TensorList packs,
                                 at::TensorList panels, at::IntArrayRef layers, int64_t members,
                                 int64_t molecules, int64_t divisor, bool zero_blocks_exact,
                                 int64_t activation);
at::Tensor ensemble_energies_autograd(const at::Tensor& aev, const at::Tensor& atoms,
                                      at::IntArrayRef sizes, at::TensorList columns,
                                      at::TensorList first, at::TensorList packs,
                                      at::TensorList panels, at::IntArrayRef layers,
                                      int64_t members, int64_t molecules, int64_t divisor,
                                      bool zero_blocks_exact, int64_t activation);

// The networks' activation (0 CELU(0.1), 1 GELU) of each element of x (float32
// or float64) and its derivative, by the kernels' own code (float32: the SIMD
// functions at the current instruction-set level); simd_erf: float32 erf by
// common/simd_math.h's polynomial (std::erf below AVX2). For tests.
std::tuple<at::Tensor, at::Tensor> simd_activation_cpu(const at::Tensor& x, int64_t activation);
at::Tensor simd_erf_cpu(const at::Tensor& x);

// weights_state (ensemble/weights_cpu.cpp): whether any of params requires grad, and a
// fingerprint of their storages, offsets and version counters, which changes
// when one of them is modified in place (load_state_dict, copy_, an optimizer
// step) or given new storage (param.data = ...). PackCache::check drops the
// packed copies when it changes (ensemble/pack_cache.h). Writes through .data do not count: .data has
// its own version counter.
std::tuple<bool, int64_t> weights_state(at::TensorList params);

// group_atoms: how FusedEnsemble groups atoms for layer 1 (nn.py, _groups):
// one group per element present, reading the AEV columns of every element
// present (a bitmask); with aev (rows, features) given, split_min_atoms > 0 and
// at least 2 * split_min_atoms rows, an element's atoms are split in two groups when
// some present elements are seen (nonzero radial block of width radial_sublen)
// by at most a quarter of them and at least split_min_atoms see none: those
// skip the columns of these "rare" elements. Returns the atoms (flat indices
// of elements 0 .. num_species-1) group after group, each group in index
// order, and groups (G, 3): element, column bitmask, size.
std::tuple<at::Tensor, at::Tensor> group_atoms_cpu(const at::Tensor& elem_idxs,
                                                   int64_t num_species,
                                                   const c10::optional<at::Tensor>& aev,
                                                   int64_t radial_sublen, int64_t split_min_atoms);

// Input validation in one pass (validate/validate_cpu.cpp; torchani_fast/validation.py
// words the errors). first_invalid_atom: the flat index of the first atom with
// species < -1, or species >= 0 and a non-finite coordinate; -1 if none.
// convert_species: conv[atomic_nums] (TorchANI's SpeciesConverter table, -1
// reading its last entry) and the flat index of the first atomic number that
// is out of the table or unsupported (-1 if none; the output is then unset).
int64_t first_invalid_atom_cpu(const at::Tensor& species, const at::Tensor& coords);
// valid_cell (neighbors/neighbors_cpu.cpp): cell (3, 3) finite and, if any pbc, not
// singular by the neighbour search's own test (neighbors::singular_cell), the
// test validation.check_cell_pbc words the error of.
bool valid_cell_cpu(const at::Tensor& cell, const at::Tensor& pbc);
std::tuple<at::Tensor, int64_t> convert_species_cpu(const at::Tensor& atomic_nums,
                                                    const at::Tensor& conv);

// Argument checks shared by every backend (names the argument and the value).
void check_aev_inputs(const char* op, const at::Tensor& species, const at::Tensor& pairs,
                      const at::Tensor& diff_vectors, const AEVParams& p);

}  // namespace torchani_fast
