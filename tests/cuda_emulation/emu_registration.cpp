// Registers the emulated CUDA entry points as torch.ops.torchani_fast_emu.* (a
// catch-all kernel each, called with CPU tensors). Compiled with
// -Dtorchani_fast=torchani_fast_emu, so nothing clashes with the real library.
#include <torch/library.h>

#include "ops.h"

namespace torchani_fast {
namespace {

AEVParams params(const at::Tensor& r_eta, const at::Tensor& r_shifts, const at::Tensor& a_eta,
                 const at::Tensor& a_zeta, const at::Tensor& a_shifts, const at::Tensor& a_sections,
                 double rc_r, double rc_a, int64_t num_species) {
  return AEVParams{r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r, rc_a, num_species};
}

at::Tensor aev(const at::Tensor& species, const at::Tensor& pairs, const at::Tensor& diff,
               const at::Tensor& r_eta, const at::Tensor& r_shifts, const at::Tensor& a_eta,
               const at::Tensor& a_zeta, const at::Tensor& a_shifts, const at::Tensor& a_sections,
               double rc_r, double rc_a, int64_t num_species) {
  return aev_forward_cuda(species, pairs, diff,
                          params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r, rc_a,
                                 num_species));
}

at::Tensor aev_backward(const at::Tensor& grad_aev, const at::Tensor& species,
                        const at::Tensor& pairs, const at::Tensor& diff, const at::Tensor& r_eta,
                        const at::Tensor& r_shifts, const at::Tensor& a_eta,
                        const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                        const at::Tensor& a_sections, double rc_r, double rc_a,
                        int64_t num_species) {
  return aev_backward_cuda(grad_aev, species, pairs, diff,
                           params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r, rc_a,
                                  num_species));
}

at::Tensor aev_jvp(const at::Tensor& tangent, const at::Tensor& species, const at::Tensor& pairs,
                   const at::Tensor& diff, const at::Tensor& r_eta, const at::Tensor& r_shifts,
                   const at::Tensor& a_eta, const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                   const at::Tensor& a_sections, double rc_r, double rc_a, int64_t num_species) {
  return aev_jvp_cuda(tangent, species, pairs, diff,
                      params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r, rc_a,
                             num_species));
}

at::Tensor aev_double_backward(const at::Tensor& grad_aev, const at::Tensor& tangent,
                               const at::Tensor& species, const at::Tensor& pairs,
                               const at::Tensor& diff, const at::Tensor& r_eta,
                               const at::Tensor& r_shifts, const at::Tensor& a_eta,
                               const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                               const at::Tensor& a_sections, double rc_r, double rc_a,
                               int64_t num_species) {
  return aev_double_backward_cuda(grad_aev, tangent, species, pairs, diff,
                                  params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections,
                                         rc_r, rc_a, num_species));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff, const at::Tensor& r_eta,
    const at::Tensor& r_shifts, const at::Tensor& a_eta, const at::Tensor& a_zeta,
    const at::Tensor& a_shifts, const at::Tensor& a_sections, double rc_r, double rc_a,
    int64_t num_species) {
  return aev_local_derivatives_cuda(grad_aev, columns, species, pairs, diff,
                                    params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections,
                                           rc_r, rc_a, num_species));
}

}  // namespace
}  // namespace torchani_fast

#define EMU_AEV_ARGS                                                                        \
  "Tensor species, Tensor pairs, Tensor diff_vectors, Tensor radial_eta, "                  \
  "Tensor radial_shifts, Tensor angular_eta, Tensor angular_zeta, Tensor angular_shifts, "  \
  "Tensor angular_sections, float radial_cutoff, float angular_cutoff, int num_species"

TORCH_LIBRARY(torchani_fast_emu, m) {
  m.def(
      "neighbor_pairs(Tensor species, Tensor coords, Tensor? cell, Tensor? pbc, float cutoff, "
      "bool cell_list) -> (Tensor pairs, Tensor images)",
      &torchani_fast::neighbor_pairs_cuda);
  m.def(
      "neighbor_pairs_padded(Tensor species, Tensor coords, Tensor? cell, Tensor? pbc, "
      "float cutoff, bool cell_list, int max_pairs) -> (Tensor pairs, Tensor images, "
      "Tensor num_pairs)",
      &torchani_fast::neighbor_pairs_padded_cuda);
  m.def("aev(" EMU_AEV_ARGS ") -> Tensor", &torchani_fast::aev);
  m.def("aev_backward(Tensor grad_aev, " EMU_AEV_ARGS ") -> Tensor", &torchani_fast::aev_backward);
  m.def("aev_jvp(Tensor tangent, " EMU_AEV_ARGS ") -> Tensor", &torchani_fast::aev_jvp);
  m.def("aev_double_backward(Tensor grad_aev, Tensor tangent, " EMU_AEV_ARGS ") -> Tensor",
        &torchani_fast::aev_double_backward);
  m.def("aev_local_derivatives(Tensor grad_aev, Tensor columns, " EMU_AEV_ARGS
        ") -> (Tensor local_atoms, Tensor jacobian, Tensor curvature)",
        &torchani_fast::aev_local_derivatives);
}
