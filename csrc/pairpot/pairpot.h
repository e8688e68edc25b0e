// TorchANI's pair potentials on a neighbour list: the math shared by the CPU
// kernels (pairpot_cpu.cpp) and the differentiable ATen gradient that autograd
// uses under create_graph=True (pairpot_grad.cpp).
//
// Per pair q = (i, j) at distance r (Å), d = r * angstrom_to_bohr, with the
// pair potential's envelope fc(r) (its own cutoff; CutoffSmooth, CutoffCosine
// or none for an infinite cutoff) and the ghost factor g_q (0.5 if i or j is a
// ghost atom, else 1):
//
//   repulsion  e_q = g_q fc(r) y_ab / d exp(-sqrt_alpha_ab d^k_ab),  d = max(r, 1e-7) a2b
//   D3(BJ)     e_q = g_q C6_q h(r),
//              h(r) = -fc(r) (s6 / (d^6 + D_ab^6) + 3 s8 Q_ab / (d^8 + D_ab^8)),
//              D_ab = a1 R0_ab + a2,  Q_ab = sqrt_charge_ab,  R0_ab = cutoff_radii
//              C6_q = (Z + eps) / (W + eps), over the 5 x 5 reference grid:
//              Z = sum_ab c6[a, b] w[a, b], W = sum_ab w[a, b] (c6 > 0 only),
//              w[a, b] = exp(-k3 (cn_i - A_si[a])^2) exp(-k3 (cn_j - B_sj[b])^2),
//              cn_a = sum of count(d_q) over the pairs q of atom a (no envelope),
//              count(d) = 1 / (1 + exp(-k1 (k2 (rcov_i + rcov_j) / d - 1))).
//
// Energies are the sums of e_q per molecule, or with atomic=True e_q / 2 to
// each of i and j. Pairs with a negative index (unused slots of a fixed-capacity
// list), with a padding atom (element -1) or farther apart than the cutoff are
// ignored (TorchANI's discard_outside_cutoff drops the latter before the call).
//
// The gradient w.r.t. the distances, for an incoming gradient giving pair q the
// weight w_q (the molecule's, or the mean of its two atoms' with atomic=True):
//   repulsion  dE/dr_q = w_q de_q/dr_q
//   D3         dE/dr_q = w_q C6_q g_q h'(r_q) + (G_i + G_j) count'(r_q),
//              G_a = sum over the pairs p of a of w_p g_p h_p dC6_p / dcn_a.
// The forward keeps the per-pair factors of these sums ("derivs", see ops.h).
#pragma once

#include <ATen/ATen.h>

#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace torchani_fast {

// The envelope of a pair potential (the ops' cutoff_kind).
constexpr int64_t kPairCutoffCosine = 0;  // 0.5 cos(pi r / rc) + 0.5
constexpr int64_t kPairCutoffSmooth = 1;  // exp(1 - 1 / max(eps, 1 - (r / rc)^order))
constexpr int64_t kPairCutoffNone = 2;    // 1 (CutoffDummy: the cutoff is infinite)

struct PairCutoff {
  double cutoff;
  int64_t kind, order;
  double eps;
};

// The envelope's value f and slope df at r (Å), as TorchANI's Cutoff modules
// compute them (the slope where the smooth kind's clamp is active is 0, as
// autograd gives through clamp).
template <typename T>
inline void envelope(const PairCutoff& c, T r, T& f, T& df) {
  if (c.kind == kPairCutoffNone) {
    f = T(1);
    df = T(0);
  } else if (c.kind == kPairCutoffCosine) {
    const T k = static_cast<T>(M_PI / c.cutoff);
    f = T(0.5) * std::cos(r * k) + T(0.5);
    df = T(-0.5) * k * std::sin(r * k);
  } else {
    const T rc = static_cast<T>(c.cutoff), eps = static_cast<T>(c.eps);
    const T x = r / rc;
    T xn1 = T(1);  // x^(order - 1)
    for (int64_t o = 1; o < c.order; ++o) xn1 *= x;
    const T raw = T(1) - xn1 * x;
    const T s = raw < eps ? eps : raw;
    f = std::exp(T(1) - T(1) / s);
    df = raw >= eps ? f / (s * s) * (-static_cast<T>(c.order) * xn1 / rc) : T(0);
  }
}

// Constants of RepulsionXTB: (T, T) tables of the element pairs.
struct RepulsionParams {
  at::Tensor y_ab, sqrt_alpha_ab, k_rep_ab;
  double angstrom_to_bohr;
  PairCutoff cut;
};

// Constants of TwoBodyDispersionD3: its buffers as TorchANI keeps them
// (coeff6, coordnums_a, coordnums_b (T, T, 5, 5); covalent_radii (T,) in bohr;
// sqrt_charge_ab, cutoff_radii (T, T)) and its scalars. The reference grid must
// be a product grid (coordnums_a[s, t, a, b] depends on s and a only where
// coeff6 > 0, coordnums_b on t and b): torchani_fast.potentials checks it.
struct D3Params {
  at::Tensor coeff6, coordnums_a, coordnums_b, covalent_radii, sqrt_charge_ab, cutoff_radii;
  double s6, s8, a1, a2, k1, k2, k3, eps;
  double angstrom_to_bohr;
  PairCutoff cut;
};

// Argument checks shared by the kernels and the ATen gradient (names the op,
// the argument and the value).
void check_pair_inputs(const char* op, const at::Tensor& elem_idxs, const at::Tensor& pairs,
                       const at::Tensor& distances, const c10::optional<at::Tensor>& ghost_flags,
                       const PairCutoff& cut);
void check_repulsion_params(const char* op, const RepulsionParams& p, const at::Tensor& distances);
void check_d3_params(const char* op, const D3Params& p, const at::Tensor& distances);

// dE/d distances with differentiable ATen ops (recorded by autograd when grad
// mode is on, so that Hessians can differentiate it again); grad_energies has
// the shape of the op's energies.
at::Tensor repulsion_grad_aten(const at::Tensor& grad_energies, const at::Tensor& elem_idxs,
                               const at::Tensor& pairs, const at::Tensor& distances,
                               const c10::optional<at::Tensor>& ghost_flags, bool atomic,
                               const RepulsionParams& p);
at::Tensor d3_grad_aten(const at::Tensor& grad_energies, const at::Tensor& elem_idxs,
                        const at::Tensor& pairs, const at::Tensor& distances,
                        const c10::optional<at::Tensor>& ghost_flags, bool atomic,
                        const D3Params& p);

// The kernels (registered in registration.cpp): TorchANI's RepulsionXTB and
// TwoBodyDispersionD3 on a neighbour list, from its distances (P,)
// (differentiable; Å). Each returns the energies (M,) or,
// with atomic, (M, A), and derivs: with derivatives=True the per-pair factors
// of the gradient, (P, 1) for the repulsion (de_q/dr_q) and (P, 4) for D3
// (de_q/dr_q at fixed coordination numbers, de_q/dcn_i, de_q/dcn_j,
// dcount_q/dr_q), the ghost factor included; otherwise (0, 1) or (0, 4).
// pair_energies_backward(grad, derivs) is the gradient w.r.t. the distances
// (P,) of sum(grad * energies), in pair order (not differentiable). The
// Autograd kernels (autograd.cpp) keep derivs and call it, or, when the
// backward is itself recorded (create_graph=True), the differentiable ATen
// form of the same gradient (pairpot/pairpot_grad.cpp). Flat schema
// signatures: PairPotentialOp below.
std::tuple<at::Tensor, at::Tensor> repulsion_xtb_cpu(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const RepulsionParams& p);
std::tuple<at::Tensor, at::Tensor> dispersion_d3_cpu(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const D3Params& p);
std::tuple<at::Tensor, at::Tensor> repulsion_xtb_autograd(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const RepulsionParams& p);
std::tuple<at::Tensor, at::Tensor> dispersion_d3_autograd(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const D3Params& p);
at::Tensor pair_energies_backward_cpu(const at::Tensor& grad_energies, const at::Tensor& derivs,
                                      const at::Tensor& pairs, const at::Tensor& elem_idxs,
                                      bool atomic);

// The schemas spell the parameters out: elem_idxs, pairs, distances,
// ghost_flags, atomic, the tables, the scalars, angstrom_to_bohr, cutoff,
// cutoff_kind, cutoff_order, cutoff_eps, derivatives.
// PairPotentialOp<Params>::flat<kernel> is `kernel` with that signature.
template <typename P>
struct PairPotentialOp;

template <>
struct PairPotentialOp<RepulsionParams> {
  using Kernel = std::tuple<at::Tensor, at::Tensor> (*)(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
      bool, bool, const RepulsionParams&);
  using Schema = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
      bool, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, int64_t,
      int64_t, double, bool);
  template <Kernel kernel>
  static std::tuple<at::Tensor, at::Tensor> flat(
      const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
      const c10::optional<at::Tensor>& ghost_flags, bool atomic, const at::Tensor& y_ab,
      const at::Tensor& sqrt_alpha_ab, const at::Tensor& k_rep_ab, double angstrom_to_bohr,
      double cutoff, int64_t cutoff_kind, int64_t cutoff_order, double cutoff_eps,
      bool derivatives) {
    return kernel(elem_idxs, pairs, distances, ghost_flags, atomic, derivatives,
                  RepulsionParams{y_ab, sqrt_alpha_ab, k_rep_ab, angstrom_to_bohr,
                                  {cutoff, cutoff_kind, cutoff_order, cutoff_eps}});
  }
  // Calls the op `handle` (of Schema) with p spelled out.
  template <typename Handle>
  static std::tuple<at::Tensor, at::Tensor> call(
      const Handle& op, const at::Tensor& elem_idxs, const at::Tensor& pairs,
      const at::Tensor& distances, const c10::optional<at::Tensor>& ghost_flags, bool atomic,
      bool derivatives, const RepulsionParams& p) {
    return op.call(elem_idxs, pairs, distances, ghost_flags, atomic, p.y_ab, p.sqrt_alpha_ab,
                   p.k_rep_ab, p.angstrom_to_bohr, p.cut.cutoff, p.cut.kind, p.cut.order,
                   p.cut.eps, derivatives);
  }
};

template <>
struct PairPotentialOp<D3Params> {
  using Kernel = std::tuple<at::Tensor, at::Tensor> (*)(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
      bool, bool, const D3Params&);
  using Schema = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
      bool, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, double, double, double, double, double, double,
      double, double, double, double, int64_t, int64_t, double, bool);
  template <Kernel kernel>
  static std::tuple<at::Tensor, at::Tensor> flat(
      const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
      const c10::optional<at::Tensor>& ghost_flags, bool atomic, const at::Tensor& coeff6,
      const at::Tensor& coordnums_a, const at::Tensor& coordnums_b,
      const at::Tensor& covalent_radii, const at::Tensor& sqrt_charge_ab,
      const at::Tensor& cutoff_radii, double s6, double s8, double a1, double a2, double k1,
      double k2, double k3, double eps, double angstrom_to_bohr, double cutoff,
      int64_t cutoff_kind, int64_t cutoff_order, double cutoff_eps, bool derivatives) {
    return kernel(elem_idxs, pairs, distances, ghost_flags, atomic, derivatives,
                  D3Params{coeff6, coordnums_a, coordnums_b, covalent_radii, sqrt_charge_ab,
                           cutoff_radii, s6, s8, a1, a2, k1, k2, k3, eps, angstrom_to_bohr,
                           {cutoff, cutoff_kind, cutoff_order, cutoff_eps}});
  }
  template <typename Handle>
  static std::tuple<at::Tensor, at::Tensor> call(
      const Handle& op, const at::Tensor& elem_idxs, const at::Tensor& pairs,
      const at::Tensor& distances, const c10::optional<at::Tensor>& ghost_flags, bool atomic,
      bool derivatives, const D3Params& p) {
    return op.call(elem_idxs, pairs, distances, ghost_flags, atomic, p.coeff6, p.coordnums_a,
                   p.coordnums_b, p.covalent_radii, p.sqrt_charge_ab, p.cutoff_radii, p.s6,
                   p.s8, p.a1, p.a2, p.k1, p.k2, p.k3, p.eps, p.angstrom_to_bohr,
                   p.cut.cutoff, p.cut.kind, p.cut.order, p.cut.eps, derivatives);
  }
};

}  // namespace torchani_fast
