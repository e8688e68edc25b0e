// The three-launch CUDA neighbour search (neighbors/neighbor_rows_cuda.cu) and
// the switch between it and the older one (neighbors/neighbors_cuda.cu):
// TORCHANI_FAST_CUDA_NEIGHBORS=old|new, read once (unset: new; anything else
// raises). Same signatures and outputs as neighbor_pairs(_padded)_cuda.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace torchani_fast {

bool use_row_neighbors();

std::tuple<at::Tensor, at::Tensor> neighbor_pairs_rows_cuda(const at::Tensor& species,
                                                            const at::Tensor& coords,
                                                            const c10::optional<at::Tensor>& cell,
                                                            const c10::optional<at::Tensor>& pbc,
                                                            double cutoff, bool cell_list);

std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_rows_cuda(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs);

}  // namespace torchani_fast
