// Input checks of a patched model in one pass over the atoms (CPU), so that a
// valid call costs one op instead of ~15 small ATen reductions. They only find
// the first offending atom; torchani_fast/validation.py words the error (it
// reruns its own checks, which name the argument and the value).
#include <ATen/ATen.h>

#include <cmath>

#include "neighbors/cell_bins.h"
#include "neighbors/read_cell.h"
#include "ops.h"

namespace torchani_fast {

int64_t first_invalid_atom_cpu(const at::Tensor& species, const at::Tensor& coords) {
  TORCH_CHECK(species.dim() == 2 && coords.dim() == 3 && coords.size(0) == species.size(0) &&
                  coords.size(1) == species.size(1) && coords.size(2) == 3,
              "first_invalid_atom: species must be (M, A) and coords (M, A, 3), got ",
              species.sizes(), " and ", coords.sizes());
  TORCH_CHECK(species.scalar_type() == at::kLong || species.scalar_type() == at::kInt,
              "first_invalid_atom: species must be int64 or int32");
  const at::Tensor s = species.contiguous();
  const at::Tensor x = coords.contiguous();
  const int64_t n = s.numel();
  int64_t bad = -1;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "first_invalid_atom", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    auto scan = [&](auto* sp) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t z = static_cast<int64_t>(sp[i]);
        if (z < -1) return i;
        if (z >= 0 && !(std::isfinite(xp[3 * i]) && std::isfinite(xp[3 * i + 1]) &&
                        std::isfinite(xp[3 * i + 2])))
          return i;
      }
      return int64_t(-1);
    };
    bad = s.scalar_type() == at::kLong ? scan(s.data_ptr<int64_t>()) : scan(s.data_ptr<int32_t>());
  });
  return bad;
}

std::tuple<at::Tensor, int64_t> convert_species_cpu(const at::Tensor& atomic_nums,
                                                    const at::Tensor& conv) {
  TORCH_CHECK(atomic_nums.scalar_type() == at::kLong || atomic_nums.scalar_type() == at::kInt,
              "convert_species: atomic_nums must be int64 or int32");
  TORCH_CHECK(conv.dim() == 1 && conv.size(0) >= 1 && conv.scalar_type() == at::kLong,
              "convert_species: conv must be a non-empty 1-D int64 tensor");
  const at::Tensor z = atomic_nums.contiguous();
  const at::Tensor table = conv.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t size = table.size(0), n = z.numel();
  at::Tensor out = at::empty(z.sizes(), table.options());
  int64_t* op = out.data_ptr<int64_t>();
  // conv[z], z = -1 reading the last entry, as TorchANI's indexing does.
  auto run = [&](auto* zp) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = static_cast<int64_t>(zp[i]);
      if (a < -1 || a >= size - 1) return i;
      const int64_t e = tp[a < 0 ? size - 1 : a];
      if (e < 0 && a >= 0) return i;
      op[i] = e;
    }
    return int64_t(-1);
  };
  const int64_t bad =
      z.scalar_type() == at::kLong ? run(z.data_ptr<int64_t>()) : run(z.data_ptr<int32_t>());
  return {out, bad};
}

bool valid_cell_cpu(const at::Tensor& cell, const at::Tensor& pbc) {
  TORCH_CHECK(cell.dim() == 2 && cell.size(0) == 3 && cell.size(1) == 3,
              "valid_cell: cell must be (3, 3), got ", cell.sizes());
  TORCH_CHECK(pbc.numel() == 3 && pbc.scalar_type() == at::kBool,
              "valid_cell: pbc must be 3 bools, got ", pbc.sizes(), " ", pbc.scalar_type());
  double C[9];
  neighbors::read_cell(cell, C);
  for (double v : C)
    if (!std::isfinite(v)) return false;
  const at::Tensor p = pbc.contiguous();
  const bool* pp = p.data_ptr<bool>();
  return !(pp[0] || pp[1] || pp[2]) || !neighbors::singular_cell(C, neighbors::cell_determinant(C));
}

}  // namespace torchani_fast
