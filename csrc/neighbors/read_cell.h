// The (3, 3) cell, any float dtype and strides, into C (row-major double), with
// no ATen op: used by the CPU neighbour search and by valid_cell.
#pragma once

#include <ATen/ATen.h>

namespace torchani_fast {
namespace neighbors {

inline void read_cell(const at::Tensor& cell, double* C) {
  AT_DISPATCH_FLOATING_TYPES(cell.scalar_type(), "read_cell", [&] {
    const auto c = cell.accessor<scalar_t, 2>();
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 3; ++j) C[3 * i + j] = static_cast<double>(c[i][j]);
  });
}

}  // namespace neighbors
}  // namespace torchani_fast
