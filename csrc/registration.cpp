// The only file that declares torchani_fast ops (schemas.h): every schema and
// every dispatch-key registration. Fake (meta) kernels are registered from
// Python in torchani_fast/ops.py. The AEV kernels take an AEVParams; AevOp
// (ops.h) gives them the flat signature of their schema.
#include <Python.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"
#include "pairpot/pairpot.h"
#include "schemas.h"
#include "common/parallel.h"
#include "common/simd_math.h"
#include "common/workspace.h"
#include "ensemble/pack_cache.h"

TORCH_LIBRARY(torchani_fast, m) {
  using namespace torchani_fast::schema;
  using torchani_fast::PackCache;
  m.class_<PackCache>("PackCache")
      .def(torch::init<>())
      .def("watch", &PackCache::watch)
      .def("check", &PackCache::check)
      .def("epoch", &PackCache::epoch)
      .def("get", &PackCache::get)
      .def("put", &PackCache::put)
      .def("clear", &PackCache::clear)
      .def("keys", &PackCache::keys)
      .def("tensors", &PackCache::tensors)
      .def("dict", &PackCache::dict)
      // torch.export fakes every TorchScript object a module holds unless it says it is
      // traced as it is: a cache of packed weights that the traced path (the networks
      // evaluated op by op) never reads.
      .def("tracing_mode", [](const c10::intrusive_ptr<PackCache>&) -> std::string { return "real"; })
      .def_pickle([](const c10::intrusive_ptr<PackCache>&) -> int64_t { return 0; },
                  [](int64_t) { return c10::make_intrusive<PackCache>(); });
  using torchani_fast::Workspace;
  m.class_<Workspace>("Workspace")
      .def(torch::init<>())
      .def("enter", &Workspace::enter)
      .def("exit", &Workspace::exit)
      .def("nbytes", &Workspace::nbytes)
      .def_static("min_bytes", &Workspace::min_bytes);
  for (const char* schema :
       {kNeighborPairs, kNeighborPairsPadded, kPairVectors, kPairVectorsBackward, kAev,
        kAevWithEdges, kAevBackwardEdges, kAevBackward, kAevJvp, kAevDoubleBackward, kAevLocalDerivatives, kEnsembleMlp,
        kEnsembleMlpBackward, kEnsembleAtomic, kEnsembleEnergies, kEnsembleTrain, kEnsembleDense, kWeightsState, kGroupAtoms,
        kFirstInvalidAtom, kValidCell, kConvertSpecies, kSimdActivation, kSimdErf,
        kRepulsionXtb, kDispersionD3, kPairEnergiesBackward}) {
    m.def(schema);
  }
}

TORCH_LIBRARY_IMPL(torchani_fast, CPU, m) {
  using namespace torchani_fast;
  m.impl("neighbor_pairs", &neighbor_pairs_cpu);
  m.impl("neighbor_pairs_padded", &neighbor_pairs_padded_cpu);
  m.impl("pair_vectors", &pair_vectors_cpu);
  m.impl("pair_vectors_backward", &pair_vectors_backward_cpu);
  m.impl("aev", &AevForwardOp::flat<&aev_forward_cpu>);
  m.impl("aev_backward", &AevBackwardOp::flat<&aev_backward_cpu>);
  m.impl("aev_with_edges", &AevWithEdgesOp::flat<&aev_with_edges_cpu>);
  m.impl("aev_backward_edges", &AevBackwardEdgesOp::flat<&aev_backward_edges_cpu>);
  m.impl("aev_jvp", &AevBackwardOp::flat<&aev_jvp_cpu>);
  m.impl("aev_double_backward", &AevDoubleBackwardOp::flat<&aev_double_backward_cpu>);
  m.impl("aev_local_derivatives", &AevLocalDerivativesOp::flat<&aev_local_derivatives_cpu>);
  m.impl("ensemble_mlp", &ensemble_mlp_cpu);
  m.impl("ensemble_mlp_backward", &ensemble_mlp_backward_cpu);
  m.impl("ensemble_atomic", &ensemble_atomic_cpu);
  m.impl("ensemble_energies", &ensemble_energies_cpu);
  m.impl("simd_activation", &simd_activation_cpu);
  m.impl("simd_erf", &simd_erf_cpu);
  m.impl("group_atoms", &group_atoms_cpu);
  m.impl("first_invalid_atom", &first_invalid_atom_cpu);
  m.impl("valid_cell", &valid_cell_cpu);
  m.impl("convert_species", &convert_species_cpu);
  m.impl("repulsion_xtb", &PairPotentialOp<RepulsionParams>::flat<&repulsion_xtb_cpu>);
  m.impl("dispersion_d3", &PairPotentialOp<D3Params>::flat<&dispersion_d3_cpu>);
  m.impl("pair_energies_backward", &pair_energies_backward_cpu);
}

// One kernel for every device, above autograd: weights_state reads tensor
// metadata only, ensemble_train runs ATen ops in a C++ autograd Function.
TORCH_LIBRARY_IMPL(torchani_fast, CompositeImplicitAutograd, m) {
  m.impl("weights_state", &torchani_fast::weights_state);
  m.impl("ensemble_train", &torchani_fast::ensemble_train);
}

#ifdef TORCHANI_FAST_CUDA
TORCH_LIBRARY_IMPL(torchani_fast, CUDA, m) {
  using namespace torchani_fast;
  m.impl("neighbor_pairs", &neighbor_pairs_cuda);
  m.impl("neighbor_pairs_padded", &neighbor_pairs_padded_cuda);
  m.impl("pair_vectors", &pair_vectors_cuda);
  m.impl("pair_vectors_backward", &pair_vectors_backward_cuda);
  m.impl("aev", &AevForwardOp::flat<&aev_forward_cuda>);
  m.impl("aev_backward", &AevBackwardOp::flat<&aev_backward_cuda>);
  m.impl("aev_with_edges", &AevWithEdgesOp::flat<&aev_with_edges_cuda>);
  m.impl("aev_backward_edges", &AevBackwardEdgesOp::flat<&aev_backward_edges_cuda>);
  m.impl("aev_jvp", &AevBackwardOp::flat<&aev_jvp_cuda>);
  m.impl("aev_double_backward", &AevDoubleBackwardOp::flat<&aev_double_backward_cuda>);
  m.impl("aev_local_derivatives", &AevLocalDerivativesOp::flat<&aev_local_derivatives_cuda>);
  m.impl("ensemble_dense", &ensemble_dense_cuda);
}
#endif

TORCH_LIBRARY_IMPL(torchani_fast, Autograd, m) {
  using namespace torchani_fast;
  m.impl("neighbor_pairs", &neighbor_pairs_autograd);
  m.impl("neighbor_pairs_padded", &neighbor_pairs_padded_autograd);
  m.impl("pair_vectors", &pair_vectors_autograd);
  m.impl("aev", &AevForwardOp::flat<&aev_autograd>);
  m.impl("aev_backward", &AevBackwardOp::flat<&aev_backward_autograd>);
  m.impl("aev_backward_edges", &AevBackwardEdgesOp::flat<&aev_backward_edges_autograd>);
  m.impl("aev_jvp", &AevBackwardOp::flat<&aev_jvp_autograd>);
  m.impl("aev_double_backward", &AevDoubleBackwardOp::flat<&aev_double_backward_autograd>);
  m.impl("aev_local_derivatives", &AevLocalDerivativesOp::flat<&aev_local_derivatives_autograd>);
  m.impl("ensemble_atomic", &ensemble_atomic_autograd);
  m.impl("ensemble_energies", &ensemble_energies_autograd);
  m.impl("repulsion_xtb", &PairPotentialOp<RepulsionParams>::flat<&repulsion_xtb_autograd>);
  m.impl("dispersion_d3", &PairPotentialOp<D3Params>::flat<&dispersion_d3_autograd>);
}

// `from torchani_fast import _C` runs the static registrations above; the module
// itself (no pybind11, only the C API of Python) holds two functions:
// _C.simd_level(cap) -> the instruction-set level the CPU kernels use
// (common/simd_math.h), after capping it at `cap` if cap >= 0 (torchani_fast.cpu_isa);
// _C.parallel_counts(regions[, late_start_ns]) -> (team, pool, pool loops left,
// pool's last stretch): the CPU loops' counters (common/parallel.h), after
// setting the pool's loops left to `regions` if regions >= 0 and the late start
// that turns the pool on if late_start_ns is given (< 0: the default) (tests).
namespace {
PyObject* simd_level(PyObject*, PyObject* args) {
  int cap = -1;
  if (!PyArg_ParseTuple(args, "i", &cap)) return nullptr;
  if (cap >= 0) torchani_fast::simd::level_cap().store(cap);
  return PyLong_FromLong(torchani_fast::simd::level());
}
PyObject* parallel_counts(PyObject*, PyObject* args) {
  int regions = -1;
  long long late_start = 0;
  if (!PyArg_ParseTuple(args, "i|L", &regions, &late_start)) return nullptr;
  if (PyTuple_Size(args) > 1) torchani_fast::set_late_start(late_start);
  if (regions >= 0) torchani_fast::set_pool_regions(regions);
  const auto c = torchani_fast::parallel_counts();
  return Py_BuildValue("(LLLL)", static_cast<long long>(c.team), static_cast<long long>(c.pool),
                       static_cast<long long>(c.pool_regions_left),
                       static_cast<long long>(c.pool_period));
}
PyMethodDef methods[] = {
    {"simd_level", simd_level, METH_VARARGS, "simd_level(cap) -> level (cap < 0: unchanged)"},
    {"parallel_counts", parallel_counts, METH_VARARGS,
     "parallel_counts(regions[, late_start_ns]) -> (team, pool, pool loops left, pool's last "
     "stretch) (regions < 0: unchanged)"},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}
