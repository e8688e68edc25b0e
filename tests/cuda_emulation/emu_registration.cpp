// Registers the emulated CUDA entry points as torch.ops.torchani_fast_emu.* (a
// catch-all kernel each, called with CPU tensors). Compiled with
// -Dtorchani_fast=torchani_fast_emu, so nothing clashes with the real library;
// the schemas and the AEVParams adapters are the real ones (schemas.h, ops.h).
#include <torch/library.h>

#include "emu_runtime.h"
#include "ops.h"
#include "schemas.h"

TORCH_LIBRARY(torchani_fast_emu, m) {
  using namespace torchani_fast;
  m.def(schema::kNeighborPairs, &neighbor_pairs_cuda);
  m.def(schema::kNeighborPairsPadded, &neighbor_pairs_padded_cuda);
  m.def(schema::kPairVectors, &pair_vectors_cuda);
  m.def(schema::kPairVectorsBackward, &pair_vectors_backward_cuda);
  m.def(schema::kAev, &AevForwardOp::flat<&aev_forward_cuda>);
  m.def(schema::kAevBackward, &AevBackwardOp::flat<&aev_backward_cuda>);
  m.def(schema::kAevWithEdges, &AevWithEdgesOp::flat<&aev_with_edges_cuda>);
  m.def(schema::kAevBackwardEdges, &AevBackwardEdgesOp::flat<&aev_backward_edges_cuda>);
  m.def(schema::kAevJvp, &AevBackwardOp::flat<&aev_jvp_cuda>);
  m.def(schema::kAevDoubleBackward, &AevDoubleBackwardOp::flat<&aev_double_backward_cuda>);
  m.def(schema::kAevLocalDerivatives, &AevLocalDerivativesOp::flat<&aev_local_derivatives_cuda>);
  m.def(schema::kEnsembleDense, &ensemble_dense_cuda);
  m.def("launch_count() -> int", []() -> int64_t { return ::emu::launches.load(); });
}
