// ensemble_mlp_backward: the AEV gradient of the networks' values from the
// input gradient J that ensemble_mlp computed in its forward (ops.h): each
// atom's row is grad_values[atom] * J over the columns its group used, zeros
// elsewhere. Undefined (an empty tensor) when the members' incoming gradients
// differ, where autograd recomputes instead (autograd.cpp).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/parallel.h"
#include "common/workspace.h"
#include "ensemble/zero_chunks.h"
#include "ops.h"

namespace torchani_fast {

using namespace ensemble_detail;

at::Tensor ensemble_mlp_backward_cpu(const at::Tensor& grad_values, const at::Tensor& atoms,
                                     at::IntArrayRef sizes, at::TensorList columns,
                                     const at::Tensor& jacobian, int64_t features) {
  TORCH_CHECK(grad_values.dim() == 2,
              "ensemble_mlp_backward: grad_values must be (members, atoms), got ", grad_values.sizes());
  TORCH_CHECK(grad_values.scalar_type() == jacobian.scalar_type(),
              "ensemble_mlp_backward: grad_values and jacobian differ in dtype");
  TORCH_CHECK(atoms.dim() == 1 && atoms.scalar_type() == at::kLong && columns.size() == sizes.size(),
              "ensemble_mlp_backward: atoms must be 1-D int64 and columns have one entry per group");
  int64_t expected = 0, rows = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    expected += sizes[g] * columns[g].numel();
    rows += sizes[g];
  }
  TORCH_CHECK(rows == atoms.numel(), "ensemble_mlp_backward: sizes add up to ", rows,
              " but atoms has ", atoms.numel(), " entries");
  TORCH_CHECK(jacobian.dim() == 1 && jacobian.numel() == expected && jacobian.is_contiguous(),
              "ensemble_mlp_backward: jacobian must be flat with ", expected, " entries");
  const int64_t num_atoms = grad_values.size(1);
  const at::Tensor grad = grad_values.contiguous();
  const at::Tensor idx = atoms.contiguous();
  TORCH_CHECK(in_range(idx, num_atoms), "ensemble_mlp_backward: atoms must be distinct columns "
              "of grad_values (in [0, ", num_atoms, "))");
  const int64_t* at_ptr = idx.data_ptr<int64_t>();
  // Per atom: its group and its entry in the group (-1: in no group, a zero
  // row); an atom met twice is refused.
  std::vector<int64_t> group_of(num_atoms, -1), entry_of(num_atoms, -1);
  for (int64_t g = 0, row = 0; g < static_cast<int64_t>(sizes.size()); row += sizes[g], ++g) {
    for (int64_t r = 0; r < sizes[g]; ++r) {
      const int64_t a = at_ptr[row + r];
      TORCH_CHECK(group_of[a] < 0, "ensemble_mlp_backward: atoms must be distinct columns of "
                  "grad_values (in [0, ", num_atoms, ")), atom ", a, " repeats");
      group_of[a] = g;
      entry_of[a] = r;
    }
  }
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "ensemble_mlp_backward", [&] {
    const scalar_t* gv = grad.data_ptr<scalar_t>();
    const int64_t n = idx.numel();
    for (int64_t m = 1; m < grad.size(0); ++m) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t a = at_ptr[i];
        if (!(gv[m * num_atoms + a] == gv[a])) return;  // members differ: out stays undefined
      }
    }
    // Every row is written in one pass: zeros, then the atom's used columns,
    // while the row is in cache; the memory from the caller's workspace, if
    // any (common/workspace.h).
    out = output_empty(Workspace::kAevGrad, {num_atoms, features}, grad.options());
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* jac = jacobian.data_ptr<scalar_t>();
    std::vector<const int64_t*> cols(sizes.size());
    std::vector<int64_t> width(sizes.size());
    std::vector<at::Tensor> keep(sizes.size());
    for (size_t g = 0; g < sizes.size(); ++g) {
      keep[g] = columns[g].contiguous();
      TORCH_CHECK(in_range(keep[g], features), "ensemble_mlp_backward: columns[", g,
                  "] must be in [0, ", features, ")");
      cols[g] = keep[g].data_ptr<int64_t>();
      width[g] = keep[g].numel();
    }
    std::vector<int64_t> jac_begin(sizes.size());
    for (int64_t g = 0, off = 0; g < static_cast<int64_t>(sizes.size()); off += sizes[g] * width[g], ++g)
      jac_begin[g] = off;
    torchani_fast::parallel_for(0, num_atoms, 64, [&](int64_t begin, int64_t end) {
      for (int64_t a = begin; a < end; ++a) {
        scalar_t* dst = o + a * features;
        std::fill(dst, dst + features, scalar_t(0));
        const int64_t g = group_of[a];
        if (g < 0) continue;
        const scalar_t s = gv[a];
        const int64_t k = width[g];
        const scalar_t* j = jac + jac_begin[g] + entry_of[a] * k;
        const int64_t* c = cols[g];
        for (int64_t q = 0; q < k; ++q) dst[c[q]] = s * j[q];
      }
    });
  });
  return out.defined() ? out : at::empty({0}, grad_values.options());
}

}  // namespace torchani_fast
