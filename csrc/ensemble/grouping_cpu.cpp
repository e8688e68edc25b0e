// group_atoms: how the fused networks (torchani_fast/nn/) group a call's atoms
// by element for layer 1, and which AEV blocks each group reads (the
// zero-block rule: a block that is exactly 0 for every atom of a group is
// skipped). The one implementation of the grouping, for every device: the
// CUDA path of the networks calls it on a host copy of the species.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/parallel.h"
#include "ensemble/zero_chunks.h"
#include "ops.h"

namespace torchani_fast {

using namespace ensemble_detail;

std::tuple<at::Tensor, at::Tensor> group_atoms_cpu(const at::Tensor& elem_idxs,
                                                   int64_t num_species,
                                                   const c10::optional<at::Tensor>& aev,
                                                   int64_t radial_sublen, int64_t split_min_atoms) {
  TORCH_CHECK(elem_idxs.scalar_type() == at::kLong || elem_idxs.scalar_type() == at::kInt,
              "group_atoms: elem_idxs must be int64 or int32, got ", elem_idxs.scalar_type());
  TORCH_CHECK(num_species >= 1 && num_species <= 62, "group_atoms: num_species = ", num_species,
              " must be in [1, 62]");
  const int64_t S = num_species;
  const at::Tensor e = elem_idxs.to(at::kLong).contiguous();
  const int64_t* ep = e.data_ptr<int64_t>();
  const int64_t n = e.numel();
  auto element = [&](int64_t a) { return ep[a] >= 0 && ep[a] < S ? ep[a] : int64_t(-1); };
  std::vector<int64_t> count(S, 0);
  int64_t composition = 0;
  for (int64_t a = 0; a < n; ++a) {
    const int64_t el = element(a);
    if (el >= 0) {
      count[el]++;
      composition |= int64_t(1) << el;
    }
  }
  // The AEV, if given: the split and the order within groups read it.
  at::Tensor x;
  if (aev.has_value()) {
    x = aev->contiguous();
    const int64_t radial = S * std::max<int64_t>(radial_sublen, 0);
    TORCH_CHECK(x.dim() == 2 && x.size(0) == n && x.size(1) >= radial,
                "group_atoms: aev must be (", n, ", >= ", radial, "), got ", x.sizes());
  }
  // Rare elements per element (FusedEnsemble._groups): seen, within the radial
  // cutoff (a nonzero radial block), by at most a quarter of its atoms, when
  // enough atoms see none of them to be worth a second group.
  std::vector<int64_t> rare(S, 0), seen;
  const bool consider =
      aev.has_value() && radial_sublen > 0 && split_min_atoms > 0 && n >= 2 * split_min_atoms;
  if (consider) {
    seen.assign(n, 0);
    std::vector<int64_t> table(S * S, 0);  // [element][neighbour element]: atoms that see it
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "group_atoms", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const int64_t F = x.size(1);
      torchani_fast::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
        for (int64_t a = begin; a < end; ++a) {
          const scalar_t* row = xp + a * F;
          int64_t bits = 0;
          for (int64_t s = 0; s < S; ++s) {
            if (any_nonzero(row + s * radial_sublen, radial_sublen)) bits |= int64_t(1) << s;
          }
          seen[a] = bits;
        }
      });
    });
    for (int64_t a = 0; a < n; ++a) {
      const int64_t el = element(a);
      if (el < 0) continue;
      for (int64_t s = 0; s < S; ++s)
        if ((seen[a] >> s) & 1) table[el * S + s]++;
    }
    for (int64_t el = 0; el < S; ++el) {
      if (count[el] < 2 * split_min_atoms) continue;
      int64_t bits = 0, hits = 0;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t c = table[el * S + s];
        if (c > 0 && 4 * c <= count[el]) {
          bits |= int64_t(1) << s;
          hits += c;
        }
      }
      rare[el] = count[el] - hits < split_min_atoms ? 0 : bits;
    }
  }
  // Key 2 * element + (sees a rare element); a counting sort by key, stable in
  // the atom index (what a stable argsort gives).
  auto key = [&](int64_t a) {
    const int64_t el = element(a);
    if (el < 0) return int64_t(-1);
    return 2 * el + ((consider && (seen[a] & rare[el]) != 0) ? 1 : 0);
  };
  std::vector<int64_t> size(2 * S, 0);
  for (int64_t a = 0; a < n; ++a) {
    const int64_t k = key(a);
    if (k >= 0) size[k]++;
  }
  std::vector<int64_t> next(2 * S, 0);
  int64_t groups = 0, total = 0;
  for (int64_t k = 0; k < 2 * S; ++k) {
    next[k] = total;
    total += size[k];
    groups += size[k] > 0;
  }
  at::Tensor atoms = at::empty({total}, e.options());
  int64_t* ap = atoms.data_ptr<int64_t>();
  for (int64_t a = 0; a < n; ++a) {
    const int64_t k = key(a);
    if (k >= 0) ap[next[k]++] = a;
  }
  // Within a group, atoms with the same zero chunks of the AEV (16 columns:
  // blocks of neighbour elements or pairs that an atom lacks) side by side, so
  // that ensemble_mlp's tiles of rows skip more of them; ties in index order.
  // Only the chunks that the composition can fill are read (TorchANI's layout:
  // radial blocks, then the pairs' angular blocks in row-major triangle order;
  // all chunks if the AEV has another shape). The order is a heuristic: the
  // op finds the zero chunks from the data.
  if (x.defined() && total > 1) {
    const int64_t F = x.size(1), chunks = std::min<int64_t>(F / 16, 64);
    const int64_t R = radial_sublen, pairs = S * (S + 1) / 2, angular = F - S * R;
    std::vector<int64_t> read;  // first column of each chunk read
    if (R > 0 && R % 16 == 0 && angular > 0 && angular % (16 * pairs) == 0 && F <= 16 * 64) {
      const int64_t W = angular / pairs;
      auto add = [&](int64_t col, int64_t width) {
        for (int64_t c = col; c < col + width; c += 16) read.push_back(c);
      };
      for (int64_t s = 0; s < S; ++s)
        if ((composition >> s) & 1) add(s * R, R);
      for (int64_t s1 = 0, p = 0; s1 < S; ++s1)
        for (int64_t s2 = s1; s2 < S; ++s2, ++p)
          if ((composition >> s1) & (composition >> s2) & 1) add(S * R + p * W, W);
    } else {
      for (int64_t c = 0; c < chunks; ++c) read.push_back(16 * c);
    }
    std::vector<uint64_t> pattern(static_cast<size_t>(n), 0);
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "group_atoms", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      torchani_fast::parallel_for(0, total, 256, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          pattern[ap[i]] = nonzero_chunks(xp + ap[i] * F, read.data(), static_cast<int64_t>(read.size()));
      });
    });
    for (int64_t k = 0, begin = 0; k < 2 * S; begin += size[k], ++k)
      std::stable_sort(ap + begin, ap + begin + size[k],
                       [&](int64_t a, int64_t b) { return pattern[a] < pattern[b]; });
  }
  at::Tensor info = at::empty({groups, 3}, e.options());
  int64_t* ip = info.data_ptr<int64_t>();
  for (int64_t k = 0, g = 0; k < 2 * S; ++k) {
    if (size[k] == 0) continue;
    const int64_t el = k / 2;
    ip[3 * g] = el;
    // Atoms that see none of the rare elements skip their columns.
    ip[3 * g + 1] = k % 2 == 0 ? composition & ~rare[el] : composition;
    ip[3 * g + 2] = size[k];
    ++g;
  }
  return {atoms, info};
}

}  // namespace torchani_fast
