// The pair potentials' gradient w.r.t. the distances written with
// differentiable ATen ops (formulas: pairpot.h). The autograd kernels use it
// instead of pair_energies_backward when grad mode is on in the backward
// (create_graph=True: Hessians, force training), so that autograd can
// differentiate the gradient again; any device.
#include <cmath>

#include "pairpot/pairpot.h"

namespace torchani_fast {
namespace {

// What every potential needs: the pairs' atoms (negative slots read atom 0),
// whether each pair counts, its distances (a harmless stand-in where it does
// not, so that no inf or NaN enters the graph) and its weight from the
// incoming gradient (0 where the pair does not count; the ghost factor in).
struct PairTerms {
  at::Tensor i, j, si, sj, used, r, weight;
};

PairTerms pair_terms(const at::Tensor& grad_energies, const at::Tensor& elem_idxs,
                     const at::Tensor& pairs, const at::Tensor& distances,
                     const c10::optional<at::Tensor>& ghost_flags, bool atomic,
                     const PairCutoff& cut) {
  PairTerms t;
  const at::Tensor elem = elem_idxs.to(at::kLong).reshape(-1);
  t.i = pairs[0].clamp_min(0);
  t.j = pairs[1].clamp_min(0);
  const at::Tensor ei = elem.index_select(0, t.i), ej = elem.index_select(0, t.j);
  t.used = (pairs[0] >= 0) & (pairs[1] >= 0) & (ei >= 0) & (ej >= 0) &
           at::logical_not(distances > cut.cutoff);
  t.si = ei.clamp_min(0);
  t.sj = ej.clamp_min(0);
  const double stand_in = std::isfinite(cut.cutoff) ? cut.cutoff / 2 : 1.0;
  t.r = at::where(t.used, distances, at::full_like(distances, stand_in));
  at::Tensor w;
  if (atomic) {
    const at::Tensor g = grad_energies.reshape(-1);
    w = (g.index_select(0, t.i) + g.index_select(0, t.j)) * 0.5;
  } else {
    const int64_t atoms = elem_idxs.size(1);
    w = grad_energies.index_select(0, at::div(t.i, atoms, "floor"));
  }
  if (ghost_flags.has_value()) {
    const at::Tensor ghost = ghost_flags->to(at::kBool).reshape(-1);
    w = at::where(ghost.index_select(0, t.i) | ghost.index_select(0, t.j), w * 0.5, w);
  }
  t.weight = at::where(t.used, w, at::zeros_like(w));
  return t;
}

// The envelope and its slope (envelope() in pairpot.h).
std::pair<at::Tensor, at::Tensor> envelope_aten(const PairCutoff& c, const at::Tensor& r) {
  if (c.kind == kPairCutoffNone) return {at::ones_like(r), at::zeros_like(r)};
  if (c.kind == kPairCutoffCosine) {
    const double k = M_PI / c.cutoff;
    return {at::cos(r * k) * 0.5 + 0.5, at::sin(r * k) * (-0.5 * k)};
  }
  const at::Tensor x = r / c.cutoff;
  const at::Tensor xn1 = c.order == 1 ? at::ones_like(x) : x.pow(c.order - 1);
  const at::Tensor raw = at::rsub(xn1 * x, 1);
  const at::Tensor s = raw.clamp_min(c.eps);
  const at::Tensor f = at::exp(at::rsub(s.reciprocal(), 1));
  const at::Tensor df = at::where(raw >= c.eps, f / (s * s) * xn1 * (-c.order / c.cutoff),
                                  at::zeros_like(f));
  return {f, df};
}

at::Tensor pair_table(const at::Tensor& table, const at::Tensor& si, const at::Tensor& sj,
                      const at::Tensor& like) {
  return table.to(like.scalar_type()).reshape(-1).index_select(0, si * table.size(0) + sj);
}

}  // namespace

at::Tensor repulsion_grad_aten(const at::Tensor& grad_energies, const at::Tensor& elem_idxs,
                               const at::Tensor& pairs, const at::Tensor& distances,
                               const c10::optional<at::Tensor>& ghost_flags, bool atomic,
                               const RepulsionParams& p) {
  const PairTerms t =
      pair_terms(grad_energies, elem_idxs, pairs, distances, ghost_flags, atomic, p.cut);
  const at::Tensor y = pair_table(p.y_ab, t.si, t.sj, distances);
  const at::Tensor sa = pair_table(p.sqrt_alpha_ab, t.si, t.sj, distances);
  const at::Tensor k = pair_table(p.k_rep_ab, t.si, t.sj, distances);
  const at::Tensor d = t.r.clamp_min(1e-7) * p.angstrom_to_bohr;
  const at::Tensor dk = d.pow(k);
  const at::Tensor e0 = y / d * at::exp(-sa * dk);
  const auto [fc, dfc] = envelope_aten(p.cut, t.r);
  const at::Tensor de0 = at::where(t.r >= 1e-7, -e0 * (1 + sa * k * dk) / d * p.angstrom_to_bohr,
                                   at::zeros_like(e0));
  return t.weight * (de0 * fc + e0 * dfc);
}

at::Tensor d3_grad_aten(const at::Tensor& grad_energies, const at::Tensor& elem_idxs,
                        const at::Tensor& pairs, const at::Tensor& distances,
                        const c10::optional<at::Tensor>& ghost_flags, bool atomic,
                        const D3Params& p) {
  const PairTerms t =
      pair_terms(grad_energies, elem_idxs, pairs, distances, ghost_flags, atomic, p.cut);
  const auto dtype = distances.scalar_type();
  const int64_t n = elem_idxs.numel(), T = p.coeff6.size(0);
  const double a2b = p.angstrom_to_bohr;
  const at::Tensor d = t.r * a2b;
  // Coordination numbers (the counting function has no envelope).
  const at::Tensor rcov = p.covalent_radii.to(dtype);
  const at::Tensor rsum = rcov.index_select(0, t.si) + rcov.index_select(0, t.sj);
  const at::Tensor ex = at::exp((p.k2 * rsum / d - 1) * (-p.k1));
  const at::Tensor used = t.used.to(dtype);
  const at::Tensor count = used / (1 + ex);
  const at::Tensor dcount = -ex * count * count * p.k1 * p.k2 * rsum / (d * d) * a2b;
  const at::Tensor cn = at::zeros({n}, distances.options())
                            .index_add(0, t.i, count)
                            .index_add(0, t.j, count);
  // The reference weights per atom and their slopes.
  const at::Tensor c6 = p.coeff6.to(dtype);
  const at::Tensor ref_a = p.coordnums_a.to(dtype).diagonal(0, 0, 1).select(1, 0).t();
  const at::Tensor ref_b = p.coordnums_b.to(dtype).diagonal(0, 0, 1).select(0, 0).t();
  const at::Tensor elem = elem_idxs.to(at::kLong).reshape(-1).clamp_min(0);
  const at::Tensor xa = cn.unsqueeze(1) - ref_a.index_select(0, elem);
  const at::Tensor xb = cn.unsqueeze(1) - ref_b.index_select(0, elem);
  const at::Tensor u = at::exp(xa * xa * (-p.k3)), v = at::exp(xb * xb * (-p.k3));
  const at::Tensor du = xa * u * (-2 * p.k3), dv = xb * v * (-2 * p.k3);
  // (P, 2, Ra, Rb): the masked C6 table and the mask of each pair's elements.
  const at::Tensor mask = (c6 > 0).to(dtype);
  const at::Tensor tables = at::stack({c6 * mask, mask}, 2).reshape({T * T, 2, c6.size(2), c6.size(3)});
  const at::Tensor tab = tables.index_select(0, t.si * T + t.sj);
  const at::Tensor ui = u.index_select(0, t.i), vj = v.index_select(0, t.j);
  const at::Tensor zw = at::einsum("pkab,pa,pb->pk", {tab, ui, vj}) + p.eps;
  const at::Tensor dzw_i = at::einsum("pkab,pa,pb->pk", {tab, du.index_select(0, t.i), vj});
  const at::Tensor dzw_j = at::einsum("pkab,pa,pb->pk", {tab, ui, dv.index_select(0, t.j)});
  const at::Tensor z = zw.select(1, 0), w = zw.select(1, 1);
  const at::Tensor c6q = z / w;
  const at::Tensor dc6_i = (dzw_i.select(1, 0) - c6q * dzw_i.select(1, 1)) / w;
  const at::Tensor dc6_j = (dzw_j.select(1, 0) - c6q * dzw_j.select(1, 1)) / w;
  // The damped r^-6 and r^-8 terms.
  const at::Tensor damp = pair_table(p.cutoff_radii, t.si, t.sj, distances) * p.a1 + p.a2;
  const at::Tensor q3 = pair_table(p.sqrt_charge_ab, t.si, t.sj, distances) * 3;
  const at::Tensor damp2 = damp * damp, damp6 = damp2 * damp2 * damp2, damp8 = damp6 * damp2;
  const at::Tensor d2 = d * d, d6 = d2 * d2 * d2, d8 = d6 * d2;
  const at::Tensor t6 = (d6 + damp6).reciprocal() * p.s6, t8 = q3 / (d8 + damp8) * p.s8;
  const auto [fc, dfc] = envelope_aten(p.cut, t.r);
  const at::Tensor h = -(t6 + t8) * fc;
  const at::Tensor dh = (t6 * 6 * d2 * d2 * d / (d6 + damp6) + t8 * 8 * d6 * d / (d8 + damp8)) *
                            a2b * fc -
                        (t6 + t8) * dfc;
  const at::Tensor G = at::zeros({n}, distances.options())
                           .index_add(0, t.i, t.weight * h * dc6_i)
                           .index_add(0, t.j, t.weight * h * dc6_j);
  return t.weight * c6q * dh + (G.index_select(0, t.i) + G.index_select(0, t.j)) * dcount;
}

}  // namespace torchani_fast
