// The only file that declares torchani_fast ops: every schema and every
// dispatch-key registration. Fake (meta) kernels are registered from Python in
// torchani_fast/ops.py.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

namespace torchani_fast {
namespace {

AEVParams make_params(const at::Tensor& r_eta, const at::Tensor& r_shifts, const at::Tensor& a_eta,
                      const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                      const at::Tensor& a_sections, double rc_r, double rc_a,
                      int64_t num_species) {
  return AEVParams{r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r, rc_a, num_species};
}

at::Tensor aev_cpu(const at::Tensor& species, const at::Tensor& pairs, const at::Tensor& diff,
                   const at::Tensor& r_eta, const at::Tensor& r_shifts, const at::Tensor& a_eta,
                   const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                   const at::Tensor& a_sections, double rc_r, double rc_a, int64_t num_species) {
  return aev_forward_cpu(species, pairs, diff,
                         make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r,
                                     rc_a, num_species));
}

at::Tensor aev_backward_cpu_op(const at::Tensor& grad_aev, const at::Tensor& species,
                               const at::Tensor& pairs, const at::Tensor& diff,
                               const at::Tensor& r_eta, const at::Tensor& r_shifts,
                               const at::Tensor& a_eta, const at::Tensor& a_zeta,
                               const at::Tensor& a_shifts, const at::Tensor& a_sections,
                               double rc_r, double rc_a, int64_t num_species) {
  return aev_backward_cpu(grad_aev, species, pairs, diff,
                          make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r,
                                      rc_a, num_species));
}

#ifdef TORCHANI_FAST_CUDA
at::Tensor aev_cuda(const at::Tensor& species, const at::Tensor& pairs, const at::Tensor& diff,
                    const at::Tensor& r_eta, const at::Tensor& r_shifts, const at::Tensor& a_eta,
                    const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                    const at::Tensor& a_sections, double rc_r, double rc_a, int64_t num_species) {
  return aev_forward_cuda(species, pairs, diff,
                          make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r,
                                      rc_a, num_species));
}

at::Tensor aev_backward_cuda_op(const at::Tensor& grad_aev, const at::Tensor& species,
                                const at::Tensor& pairs, const at::Tensor& diff,
                                const at::Tensor& r_eta, const at::Tensor& r_shifts,
                                const at::Tensor& a_eta, const at::Tensor& a_zeta,
                                const at::Tensor& a_shifts, const at::Tensor& a_sections,
                                double rc_r, double rc_a, int64_t num_species) {
  return aev_backward_cuda(grad_aev, species, pairs, diff,
                           make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r,
                                       rc_a, num_species));
}

at::Tensor aev_jvp_cuda_op(const at::Tensor& tangent, const at::Tensor& species,
                           const at::Tensor& pairs, const at::Tensor& diff,
                           const at::Tensor& r_eta, const at::Tensor& r_shifts,
                           const at::Tensor& a_eta, const at::Tensor& a_zeta,
                           const at::Tensor& a_shifts, const at::Tensor& a_sections, double rc_r,
                           double rc_a, int64_t num_species) {
  return aev_jvp_cuda(tangent, species, pairs, diff,
                      make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r,
                                  rc_a, num_species));
}

at::Tensor aev_double_backward_cuda_op(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                       const at::Tensor& species, const at::Tensor& pairs,
                                       const at::Tensor& diff, const at::Tensor& r_eta,
                                       const at::Tensor& r_shifts, const at::Tensor& a_eta,
                                       const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                                       const at::Tensor& a_sections, double rc_r, double rc_a,
                                       int64_t num_species) {
  return aev_double_backward_cuda(grad_aev, tangent, species, pairs, diff,
                                  make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts,
                                              a_sections, rc_r, rc_a, num_species));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cuda_op(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff, const at::Tensor& r_eta,
    const at::Tensor& r_shifts, const at::Tensor& a_eta, const at::Tensor& a_zeta,
    const at::Tensor& a_shifts, const at::Tensor& a_sections, double rc_r, double rc_a,
    int64_t num_species) {
  return aev_local_derivatives_cuda(grad_aev, columns, species, pairs, diff,
                                    make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts,
                                                a_sections, rc_r, rc_a, num_species));
}
#endif
at::Tensor aev_jvp_cpu_op(const at::Tensor& tangent, const at::Tensor& species,
                          const at::Tensor& pairs, const at::Tensor& diff,
                          const at::Tensor& r_eta, const at::Tensor& r_shifts,
                          const at::Tensor& a_eta, const at::Tensor& a_zeta,
                          const at::Tensor& a_shifts, const at::Tensor& a_sections, double rc_r,
                          double rc_a, int64_t num_species) {
  return aev_jvp_cpu(tangent, species, pairs, diff,
                     make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections, rc_r, rc_a,
                                 num_species));
}

at::Tensor aev_double_backward_cpu_op(const at::Tensor& grad_aev, const at::Tensor& tangent,
                                      const at::Tensor& species, const at::Tensor& pairs,
                                      const at::Tensor& diff, const at::Tensor& r_eta,
                                      const at::Tensor& r_shifts, const at::Tensor& a_eta,
                                      const at::Tensor& a_zeta, const at::Tensor& a_shifts,
                                      const at::Tensor& a_sections, double rc_r, double rc_a,
                                      int64_t num_species) {
  return aev_double_backward_cpu(grad_aev, tangent, species, pairs, diff,
                                 make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts, a_sections,
                                             rc_r, rc_a, num_species));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aev_local_derivatives_cpu_op(
    const at::Tensor& grad_aev, const at::Tensor& columns, const at::Tensor& species,
    const at::Tensor& pairs, const at::Tensor& diff, const at::Tensor& r_eta,
    const at::Tensor& r_shifts,
    const at::Tensor& a_eta, const at::Tensor& a_zeta, const at::Tensor& a_shifts,
    const at::Tensor& a_sections, double rc_r, double rc_a, int64_t num_species) {
  return aev_local_derivatives_cpu(grad_aev, columns, species, pairs, diff,
                                   make_params(r_eta, r_shifts, a_eta, a_zeta, a_shifts,
                                               a_sections, rc_r, rc_a, num_species));
}

}  // namespace
}  // namespace torchani_fast

#define TORCHANI_FAST_AEV_ARGS                                                              \
  "Tensor species, Tensor pairs, Tensor diff_vectors, Tensor radial_eta, "                  \
  "Tensor radial_shifts, Tensor angular_eta, Tensor angular_zeta, Tensor angular_shifts, "  \
  "Tensor angular_sections, float radial_cutoff, float angular_cutoff, int num_species"

TORCH_LIBRARY(torchani_fast, m) {
  m.def(
      "neighbor_pairs(Tensor species, Tensor coords, Tensor? cell, Tensor? pbc, float cutoff, "
      "bool cell_list) -> (Tensor pairs, Tensor images)");
  m.def(
      "neighbor_pairs_padded(Tensor species, Tensor coords, Tensor? cell, Tensor? pbc, "
      "float cutoff, bool cell_list, int max_pairs) -> (Tensor pairs, Tensor images, "
      "Tensor num_pairs)");
  m.def("aev(" TORCHANI_FAST_AEV_ARGS ") -> Tensor");
  m.def("aev_backward(Tensor grad_aev, " TORCHANI_FAST_AEV_ARGS ") -> Tensor");
  m.def("aev_jvp(Tensor tangent, " TORCHANI_FAST_AEV_ARGS ") -> Tensor");
  m.def("aev_double_backward(Tensor grad_aev, Tensor tangent, " TORCHANI_FAST_AEV_ARGS
        ") -> Tensor");
  m.def("aev_local_derivatives(Tensor grad_aev, Tensor columns, " TORCHANI_FAST_AEV_ARGS
        ") -> (Tensor local_atoms, Tensor jacobian, Tensor curvature)");
}

TORCH_LIBRARY_IMPL(torchani_fast, CPU, m) {
  m.impl("neighbor_pairs", &torchani_fast::neighbor_pairs_cpu);
  m.impl("neighbor_pairs_padded", &torchani_fast::neighbor_pairs_padded_cpu);
  m.impl("aev", &torchani_fast::aev_cpu);
  m.impl("aev_backward", &torchani_fast::aev_backward_cpu_op);
  m.impl("aev_jvp", &torchani_fast::aev_jvp_cpu_op);
  m.impl("aev_double_backward", &torchani_fast::aev_double_backward_cpu_op);
  m.impl("aev_local_derivatives", &torchani_fast::aev_local_derivatives_cpu_op);
}

#ifdef TORCHANI_FAST_CUDA
TORCH_LIBRARY_IMPL(torchani_fast, CUDA, m) {
  m.impl("neighbor_pairs", &torchani_fast::neighbor_pairs_cuda);
  m.impl("neighbor_pairs_padded", &torchani_fast::neighbor_pairs_padded_cuda);
  m.impl("aev", &torchani_fast::aev_cuda);
  m.impl("aev_backward", &torchani_fast::aev_backward_cuda_op);
  m.impl("aev_jvp", &torchani_fast::aev_jvp_cuda_op);
  m.impl("aev_double_backward", &torchani_fast::aev_double_backward_cuda_op);
  m.impl("aev_local_derivatives", &torchani_fast::aev_local_derivatives_cuda_op);
}
#endif

TORCH_LIBRARY_IMPL(torchani_fast, Autograd, m) {
  m.impl("neighbor_pairs", &torchani_fast::neighbor_pairs_autograd);
  m.impl("neighbor_pairs_padded", &torchani_fast::neighbor_pairs_padded_autograd);
  m.impl("aev", &torchani_fast::aev_autograd);
  m.impl("aev_backward", &torchani_fast::aev_backward_autograd);
  m.impl("aev_jvp", &torchani_fast::aev_jvp_autograd);
  m.impl("aev_double_backward", &torchani_fast::aev_double_backward_autograd);
  m.impl("aev_local_derivatives", &torchani_fast::aev_local_derivatives_autograd);
}

// `from torchani_fast import _C` runs the static registrations above; the module
// itself is empty (no pybind11), so it only depends on the C API of Python.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
