// Neighbour pairs within a cutoff for batches of molecules, periodic or not.
//
// One algorithm covers every case. Positions are expressed in fractional
// coordinates of the cell (the identity "cell" when there is none) and sorted
// into bins; along each axis a bin is at least `cutoff` thick measured
// perpendicular to the other two cell vectors, so the neighbours of an atom lie in
// the bins within a search radius of its own. Along a periodic axis a bin index
// outside [0, nb) is a periodic image: that is how cells smaller than the cutoff
// get several images of one atom. With cell_list = false every axis has a single
// bin (the all-pairs search), which is cheaper for small systems.
//
// Output: pairs (2, P) into the flattened M*A atoms with pairs[0] <= pairs[1], and
// images (P, 3) such that x[i0] - x[i1] + images @ cell is the pair's difference
// vector for the coordinates exactly as given (not wrapped), so gradients with
// respect to both coordinates and cell are exact.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common/parallel.h"
#include "common/simd_math.h"
#include "neighbors/cell_bins.h"
#include "neighbors/read_cell.h"
#include "ops.h"

namespace torchani_fast {
namespace {

using neighbors::Axis;

struct MoleculeBins {
  std::array<Axis, 3> axis;
  std::vector<int64_t> bin_start;  // (nbins + 1,)
  std::vector<int64_t> bin_atoms;  // flattened atom indices sorted by bin
  std::vector<double> x, y, z;     // their wrapped coordinates, in that order (+ 8 padding)
};

// One candidate bin of atom i: bin positions [q0, q1), seen through the
// periodic image img (translation t).
struct BinScan {
  int64_t i, q0, q1;
  const double* w;    // atom i's wrapped coordinates
  const double* t;    // the image's translation
  const int64_t* img;
  double cutoff_sq;
};

inline void record_pair(const BinScan& s, int64_t j, const int64_t* shift,
                        std::vector<int64_t>& found) {
  found.push_back(j);
  // x'[i] - (x'[j] + img @ C) with x' = x - shift @ C gives
  // x[i] - x[j] + (shift[j] - shift[i] - img) @ C.
  for (int a = 0; a < 3; ++a) found.push_back(shift[3 * j + a] - shift[3 * s.i + a] - s.img[a]);
}

// The atoms of the bin within the cutoff of atom i whose pair i owns, appended
// to `found` as (j, image (3)) records; returns how many.
int64_t scan_bin(const BinScan& s, const MoleculeBins& mol, const int64_t* shift,
                 std::vector<int64_t>& found) {
  int64_t n = 0;
  for (int64_t q = s.q0; q < s.q1; ++q) {
    const int64_t j = mol.bin_atoms[q];
    if (!neighbors::owns_pair(s.i, j, s.img)) continue;
    const double v0 = s.w[0] - mol.x[q] - s.t[0], v1 = s.w[1] - mol.y[q] - s.t[1],
                 v2 = s.w[2] - mol.z[q] - s.t[2];
    const double r2 = v0 * v0 + v1 * v1 + v2 * v2;
    if (r2 > s.cutoff_sq) continue;
    record_pair(s, j, shift, found);
    ++n;
  }
  return n;
}

#ifdef TF_SIMD_AVX2
// The pairs of the candidates q + lane within the cutoff (the set bits of
// `bits`) that atom i owns, recorded in lane order; returns how many.
inline int64_t record_lanes(const BinScan& s, const MoleculeBins& mol, int64_t q, int bits,
                            const int64_t* shift, std::vector<int64_t>& found) {
  int64_t n = 0;
  while (bits) {
    const int lane = __builtin_ctz(bits);
    bits &= bits - 1;
    const int64_t j = mol.bin_atoms[q + lane];
    if (!neighbors::owns_pair(s.i, j, s.img)) continue;
    record_pair(s, j, shift, found);
    ++n;
  }
  return n;
}

// scan_bin on 4 candidates per vector. The same pairs in the same order, except
// that r^2 may round differently (fused multiply-add), which can only move a pair
// at the cutoff itself, where every term is zero.
TF_AVX2 int64_t scan_bin_avx2(const BinScan& s, const MoleculeBins& mol, const int64_t* shift,
                              std::vector<int64_t>& found) {
  const __m256d wx = _mm256_set1_pd(s.w[0]), wy = _mm256_set1_pd(s.w[1]), wz = _mm256_set1_pd(s.w[2]);
  const __m256d tx = _mm256_set1_pd(s.t[0]), ty = _mm256_set1_pd(s.t[1]), tz = _mm256_set1_pd(s.t[2]);
  const __m256d cut = _mm256_set1_pd(s.cutoff_sq);
  int64_t n = 0;
  for (int64_t q = s.q0; q < s.q1; q += 4) {
    const __m256d v0 = _mm256_sub_pd(_mm256_sub_pd(wx, _mm256_loadu_pd(mol.x.data() + q)), tx);
    const __m256d v1 = _mm256_sub_pd(_mm256_sub_pd(wy, _mm256_loadu_pd(mol.y.data() + q)), ty);
    const __m256d v2 = _mm256_sub_pd(_mm256_sub_pd(wz, _mm256_loadu_pd(mol.z.data() + q)), tz);
    const __m256d r2 = _mm256_add_pd(_mm256_add_pd(_mm256_mul_pd(v0, v0), _mm256_mul_pd(v1, v1)),
                                     _mm256_mul_pd(v2, v2));
    int bits = _mm256_movemask_pd(_mm256_cmp_pd(r2, cut, _CMP_LE_OQ));
    bits &= (1 << std::min<int64_t>(4, s.q1 - q)) - 1;  // lanes past the bin's end
    n += record_lanes(s, mol, q, bits, shift, found);
  }
  return n;
}

// scan_bin_avx2 on 8 candidates per vector (AVX-512): the same operations lane
// by lane, so the same pairs in the same order.
TF_AVX512 int64_t scan_bin_avx512(const BinScan& s, const MoleculeBins& mol, const int64_t* shift,
                                  std::vector<int64_t>& found) {
  const __m512d wx = _mm512_set1_pd(s.w[0]), wy = _mm512_set1_pd(s.w[1]), wz = _mm512_set1_pd(s.w[2]);
  const __m512d tx = _mm512_set1_pd(s.t[0]), ty = _mm512_set1_pd(s.t[1]), tz = _mm512_set1_pd(s.t[2]);
  const __m512d cut = _mm512_set1_pd(s.cutoff_sq);
  int64_t n = 0;
  for (int64_t q = s.q0; q < s.q1; q += 8) {
    const __m512d v0 = _mm512_sub_pd(_mm512_sub_pd(wx, _mm512_loadu_pd(mol.x.data() + q)), tx);
    const __m512d v1 = _mm512_sub_pd(_mm512_sub_pd(wy, _mm512_loadu_pd(mol.y.data() + q)), ty);
    const __m512d v2 = _mm512_sub_pd(_mm512_sub_pd(wz, _mm512_loadu_pd(mol.z.data() + q)), tz);
    const __m512d r2 = _mm512_add_pd(_mm512_add_pd(_mm512_mul_pd(v0, v0), _mm512_mul_pd(v1, v1)),
                                     _mm512_mul_pd(v2, v2));
    int bits = static_cast<int>(_mm512_cmp_pd_mask(r2, cut, _CMP_LE_OQ));
    bits &= (1 << std::min<int64_t>(8, s.q1 - q)) - 1;  // lanes past the bin's end
    n += record_lanes(s, mol, q, bits, shift, found);
  }
  return n;
}
#endif

// Atoms per output chunk: about two chunks per thread, 64-256 atoms each.
inline int64_t chunk_atoms(int64_t N) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::clamp<int64_t>((N + 2 * threads - 1) / (2 * threads), 64, 256);
}
constexpr size_t kRecord = 4;    // j, image (3)

template <typename scalar_t>
void neighbors_impl(const int64_t* species, const scalar_t* coords, int64_t M, int64_t A,
                    const double* cell /* row-major 3x3 or nullptr */, const bool* pbc,
                    double cutoff, bool cell_list, int64_t chunk,
                    std::vector<std::vector<int64_t>>& found, std::vector<int64_t>& count) {
  // Cell and its inverse in double: x = f @ cell, f = x @ inv.
  double C[9] = {1, 0, 0, 0, 1, 0, 0, 0, 1}, inv[9] = {1, 0, 0, 0, 1, 0, 0, 0, 1};
  bool periodic[3] = {false, false, false};
  if (cell) {
    for (int i = 0; i < 9; ++i) C[i] = cell[i];
    neighbors::invert_cell(C, inv);
    for (int a = 0; a < 3; ++a) periodic[a] = pbc[a];
  }
  double span[3];
  neighbors::fractional_spans(cutoff, inv, span);

  const int64_t N = M * A;
  std::vector<double> frac(3 * N, 0.0);   // wrapped fractional coordinates
  std::vector<double> wrapped(3 * N, 0.0);  // wrapped Cartesian coordinates
  std::vector<int64_t> shift(3 * N, 0);  // integer translation removed by wrapping
  std::vector<int64_t> bin_of(N, -1);
  std::vector<MoleculeBins> mols(M);

  torchani_fast::parallel_for(0, M, 1, [&](int64_t mb, int64_t me) {
    for (int64_t m = mb; m < me; ++m) {
      MoleculeBins& mol = mols[m];
      double lo[3] = {INFINITY, INFINITY, INFINITY}, hi[3] = {-INFINITY, -INFINITY, -INFINITY};
      int64_t count = 0;
      for (int64_t i = m * A; i < (m + 1) * A; ++i) {
        if (species[i] < 0) continue;
        ++count;
        const scalar_t* x = coords + 3 * i;
        TORCH_CHECK(std::isfinite(static_cast<double>(x[0])) && std::isfinite(static_cast<double>(x[1])) &&
                        std::isfinite(static_cast<double>(x[2])),
                    "torchani_fast::neighbor_pairs: coords must be finite, got (", x[0], ", ", x[1],
                    ", ", x[2], ") for atom ", i - m * A, " of molecule ", m);
        for (int a = 0; a < 3; ++a) {
          double f = x[0] * inv[a] + x[1] * inv[3 + a] + x[2] * inv[6 + a];
          if (periodic[a]) shift[3 * i + a] = static_cast<int64_t>(neighbors::wrap_unit(f));
          frac[3 * i + a] = f;
          lo[a] = std::min(lo[a], f);
          hi[a] = std::max(hi[a], f);
        }
        neighbors::to_cartesian(&frac[3 * i], C, &wrapped[3 * i]);
      }
      if (count == 0) {
        mol.bin_start.assign(2, 0);
        for (auto& ax : mol.axis) ax = Axis{1, 0, 0.0, 1.0, false};
        continue;
      }
      // Keep the grid no larger than a few bins per atom (sparse or elongated
      // systems); counted in double so that no product can overflow.
      const double max_bins = 4.0 * static_cast<double>(count) + 27.0;
      int thin_axis;
      double thin_reach = 0;
      const double visits = neighbors::setup_axes(mol.axis.data(), lo, hi, periodic, span,
                                                  cell_list, max_bins, &thin_axis, &thin_reach);
      TORCH_CHECK(thin_axis < 0,
                  "torchani_fast::neighbor_pairs: the cell is too thin along lattice vector ",
                  thin_axis, " (", thin_reach, " periodic images within the cutoff)");
      TORCH_CHECK(visits <= neighbors::kMaxVisits,
                  "torchani_fast::neighbor_pairs: the cell is too small for the cutoff: the "
                  "search around each atom would visit ", visits,
                  " periodic images or bins (at most 1e6)");
      int64_t nbins = 1;
      for (const Axis& ax : mol.axis) nbins *= ax.nb;
      mol.bin_start.assign(nbins + 1, 0);
      for (int64_t i = m * A; i < (m + 1) * A; ++i) {
        if (species[i] < 0) continue;
        int64_t b = 0;
        for (int a = 0; a < 3; ++a) {
          const Axis& ax = mol.axis[a];
          const double kf = std::floor((frac[3 * i + a] - ax.lo) / ax.width);
          const int64_t k = static_cast<int64_t>(std::min(std::max(kf, 0.0), static_cast<double>(ax.nb - 1)));
          b = b * ax.nb + k;
        }
        bin_of[i] = b;
        mol.bin_start[b + 1]++;
      }
      for (int64_t b = 0; b < nbins; ++b) mol.bin_start[b + 1] += mol.bin_start[b];
      mol.bin_atoms.resize(count);
      std::vector<int64_t> cursor(mol.bin_start.begin(), mol.bin_start.end() - 1);
      for (int64_t i = m * A; i < (m + 1) * A; ++i)
        if (species[i] >= 0) mol.bin_atoms[cursor[bin_of[i]]++] = i;
      for (auto* v : {&mol.x, &mol.y, &mol.z}) v->assign(count + 8, 0.0);
      for (int64_t q = 0; q < count; ++q) {
        const double* w = &wrapped[3 * mol.bin_atoms[q]];
        mol.x[q] = w[0];
        mol.y[q] = w[1];
        mol.z[q] = w[2];
      }
    }
  });

  // Atoms are taken in chunks of `chunk`, each collecting its pairs as (j,
  // image) in atom order (count[i] of them for atom i); concatenating the
  // chunks in order gives the same output for any chunk size, so for any
  // number of threads. Chunks, unlike per-atom lists, are few and large, so
  // their memory goes back to the system once copied out instead of staying in
  // the allocator's small-object heap.
  const int64_t num_chunks = (N + chunk - 1) / chunk;
  found.assign(num_chunks, {});
  count.assign(N, 0);
  const double cutoff_sq = cutoff * cutoff;
  auto scan_fn = scan_bin;
#ifdef TF_SIMD_AVX2
  if (simd::have_avx2()) scan_fn = simd::have_avx512() ? scan_bin_avx512 : scan_bin_avx2;
#endif
  torchani_fast::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    // A bin lists its atoms in increasing order, and atom i owns no pair with
    // an atom j < i (owns_pair): its scan of a bin starts at the bin's first
    // atom j >= i. As i only grows here, that start only moves forward: kept
    // per bin of the current molecule (first_ge), found by binary search on
    // the bin's first visit (epoch_of[bin] != epoch), then advanced.
    std::vector<int64_t> first_ge, epoch_of;
    int64_t epoch = 0, current = -1;
    for (int64_t i = chunk_begin * chunk; i < std::min(N, chunk_end * chunk); ++i) {
      if (species[i] < 0) continue;
      const MoleculeBins& mol = mols[i / A];
      if (i / A != current) {
        current = i / A;
        ++epoch;
        const size_t nbins = mol.bin_start.size() - 1;
        if (first_ge.size() < nbins) {
          first_ge.resize(nbins);
          epoch_of.resize(nbins, 0);
        }
      }
      int64_t own[3];
      neighbors::split_bin(bin_of[i], mol.axis.data(), own);
      auto& mine = found[i / chunk];
      for (int64_t d0 = -mol.axis[0].reach; d0 <= mol.axis[0].reach; ++d0)
        for (int64_t d1 = -mol.axis[1].reach; d1 <= mol.axis[1].reach; ++d1)
          for (int64_t d2 = -mol.axis[2].reach; d2 <= mol.axis[2].reach; ++d2) {
            const int64_t d[3] = {d0, d1, d2};
            int64_t bin, img[3];
            if (!neighbors::offset_bin(mol.axis.data(), own, d, bin, img)) continue;
            double t[3];
            neighbors::image_translation(img, C, t);
            const int64_t end = mol.bin_start[bin + 1];
            int64_t& q0 = first_ge[bin];
            if (epoch_of[bin] != epoch) {
              epoch_of[bin] = epoch;
              const int64_t* atoms = mol.bin_atoms.data();
              q0 = std::lower_bound(atoms + mol.bin_start[bin], atoms + end, i) - atoms;
            } else {
              while (q0 < end && mol.bin_atoms[q0] < i) ++q0;
            }
            const BinScan scan{i, q0, end, &wrapped[3 * i], t, img, cutoff_sq};
            count[i] += scan_fn(scan, mol, shift.data(), mine);
          }
    }
  });
}

// Pairs and images from the chunks, in order (count[i] records belong to atom i);
// each chunk is copied out (in parallel, to its place after the chunks before
// it) and freed.
template <typename scalar_t>
void write_pairs(std::vector<std::vector<int64_t>>& found, const std::vector<int64_t>& count,
                 int64_t chunk, at::Tensor& pairs, at::Tensor& images,
                 const at::TensorOptions& long_opts, const at::TensorOptions& float_opts) {
  const int64_t num_chunks = static_cast<int64_t>(found.size());
  std::vector<int64_t> offset(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c)
    offset[c + 1] = offset[c] + static_cast<int64_t>(found[c].size()) / kRecord;
  const int64_t P = offset[num_chunks];
  pairs = at::empty({2, P}, long_opts);
  images = at::empty({P, 3}, float_opts);
  int64_t* first = pairs.data_ptr<int64_t>();
  int64_t* second = first + P;
  scalar_t* img = images.data_ptr<scalar_t>();
  const int64_t N = static_cast<int64_t>(count.size());
  torchani_fast::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      auto& f = found[c];
      int64_t p = offset[c];
      size_t q = 0;
      for (int64_t i = c * chunk; i < std::min(N, (c + 1) * chunk); ++i)
        for (int64_t k = 0; k < count[i]; ++k, ++p, q += kRecord) {
          first[p] = i;
          second[p] = f[q];
          for (int a = 0; a < 3; ++a) img[3 * p + a] = static_cast<scalar_t>(f[q + 1 + a]);
        }
      std::vector<int64_t>().swap(f);
    }
  });
}

}  // namespace

void check_neighbor_inputs(const char* op, const at::Tensor& species, const at::Tensor& coords,
                           const c10::optional<at::Tensor>& cell,
                           const c10::optional<at::Tensor>& pbc, double cutoff) {
  TORCH_CHECK(species.dim() == 2, op, ": species must have shape (molecules, atoms), got ",
              species.sizes());
  TORCH_CHECK(species.scalar_type() == at::kLong || species.scalar_type() == at::kInt, op,
              ": species must be int64 or int32, got ", species.scalar_type());
  TORCH_CHECK(coords.dim() == 3 && coords.size(2) == 3 && coords.size(0) == species.size(0) &&
                  coords.size(1) == species.size(1),
              op, ": coords must have shape ", species.sizes(), " + (3,) to match species, got ",
              coords.sizes());
  TORCH_CHECK(at::isFloatingType(coords.scalar_type()), op,
              ": coords must be float32 or float64, got ", coords.scalar_type());
  TORCH_CHECK(cutoff > 0 && std::isfinite(cutoff), op, ": cutoff must be positive, got ", cutoff);
  TORCH_CHECK(cell.has_value() == pbc.has_value(), op,
              ": cell and pbc must be given together (both or neither)");
  if (cell.has_value()) {
    TORCH_CHECK(cell->dim() == 2 && cell->size(0) == 3 && cell->size(1) == 3, op,
                ": cell must have shape (3, 3), got ", cell->sizes());
    TORCH_CHECK(pbc->numel() == 3 && pbc->scalar_type() == at::kBool, op,
                ": pbc must be a bool tensor of shape (3,), got ", pbc->sizes(), " ",
                pbc->scalar_type());
  }
}

namespace {
std::tuple<at::Tensor, at::Tensor> search_cpu(const char* op, const at::Tensor& species,
                                              const at::Tensor& coords,
                                              const c10::optional<at::Tensor>& cell,
                                              const c10::optional<at::Tensor>& pbc, double cutoff,
                                              bool cell_list) {
  check_neighbor_inputs(op, species, coords, cell, pbc, cutoff);
  double cell_d[9];
  bool pbc_h[3] = {false, false, false};
  if (cell.has_value()) {
    neighbors::read_cell(*cell, cell_d);
    auto pbc_c = pbc->contiguous();
    for (int a = 0; a < 3; ++a) pbc_h[a] = pbc_c.data_ptr<bool>()[a];
    const double det = neighbors::cell_determinant(cell_d);
    TORCH_CHECK(!neighbors::singular_cell(cell_d, det), op, ": cell is singular (determinant ",
                det, "), got cell ", *cell);
  }
  auto sp = species.to(at::kLong).contiguous();
  auto x = coords.detach().contiguous();
  const int64_t M = species.size(0), A = species.size(1);
  at::Tensor pairs, images;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "neighbor_pairs_cpu", [&] {
    std::vector<std::vector<int64_t>> found;
    std::vector<int64_t> count;
    const int64_t chunk = chunk_atoms(M * A);
    neighbors_impl<scalar_t>(sp.data_ptr<int64_t>(), x.data_ptr<scalar_t>(), M, A,
                             cell.has_value() ? cell_d : nullptr, pbc_h,
                             cutoff, cell_list, chunk, found, count);
    write_pairs<scalar_t>(found, count, chunk, pairs, images, sp.options(), x.options());
  });
  return {pairs, images};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> neighbor_pairs_cpu(
    const at::Tensor& species, const at::Tensor& coords,
    const c10::optional<at::Tensor>& cell, const c10::optional<at::Tensor>& pbc,
    double cutoff, bool cell_list) {
  return search_cpu("torchani_fast::neighbor_pairs", species, coords, cell, pbc, cutoff, cell_list);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_cpu(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs) {
  TORCH_CHECK(max_pairs >= 0, "torchani_fast::neighbor_pairs_padded: max_pairs must be >= 0, got ",
              max_pairs);
  // On the CPU the exact list costs nothing extra: search, then pad. Pairs
  // beyond the capacity are dropped, as on CUDA; num_pairs says how many exist.
  auto [found, found_images] = search_cpu("torchani_fast::neighbor_pairs_padded", species, coords,
                                          cell, pbc, cutoff, cell_list);
  const int64_t P = found.size(1), kept = std::min(P, max_pairs);
  auto pairs = at::full({2, max_pairs}, -1, found.options());
  auto images = at::zeros({max_pairs, 3}, found_images.options());
  pairs.narrow(1, 0, kept).copy_(found.narrow(1, 0, kept));
  images.narrow(0, 0, kept).copy_(found_images.narrow(0, 0, kept));
  return {pairs, images, at::scalar_tensor(P, found.options())};
}

namespace {
// pairs as a contiguous int64 (2, P) tensor whose entries index num_atoms atoms.
at::Tensor checked_pairs(const char* op, const at::Tensor& pairs, int64_t num_atoms) {
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(0) == 2 && pairs.scalar_type() == at::kLong, op,
              ": pairs must be an int64 (2, pairs) tensor, got ", pairs.scalar_type(), " ",
              pairs.sizes());
  at::Tensor idx = pairs.contiguous();
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0, n = idx.numel(); i < n; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < num_atoms, op, ": pairs must index the ", num_atoms,
                " atoms, got ", p[i]);
  return idx;
}

}  // namespace

// pair_vectors: one pass over the pairs instead of two gathers, a subtraction,
// a matrix product and a norm, each a separate ATen call (and autograd node).
std::tuple<at::Tensor, at::Tensor> pair_vectors_cpu(const at::Tensor& coords,
                                                    const at::Tensor& pairs,
                                                    const c10::optional<at::Tensor>& images,
                                                    const c10::optional<at::Tensor>& cell) {
  const char* op = "torchani_fast::pair_vectors";
  TORCH_CHECK(coords.dim() == 2 && coords.size(1) == 3 && at::isFloatingType(coords.scalar_type()),
              op, ": coords must be a float (atoms, 3) tensor, got ", coords.scalar_type(), " ",
              coords.sizes());
  const at::Tensor idx = checked_pairs(op, pairs, coords.size(0));
  TORCH_CHECK(images.has_value() == cell.has_value(), op,
              ": images and cell must be given together (both or neither)");
  const int64_t P = pairs.size(1);
  if (cell.has_value()) {
    TORCH_CHECK(cell->dim() == 2 && cell->size(0) == 3 && cell->size(1) == 3 &&
                    cell->scalar_type() == coords.scalar_type(),
                op, ": cell must be a (3, 3) tensor of the coords' dtype, got ",
                cell->scalar_type(), " ", cell->sizes());
    TORCH_CHECK(images->dim() == 2 && images->size(0) == P && images->size(1) == 3 &&
                    images->scalar_type() == coords.scalar_type(),
                op, ": images must be a (", P, ", 3) tensor of the coords' dtype, got ",
                images->scalar_type(), " ", images->sizes());
  }
  const int64_t* first = idx.data_ptr<int64_t>();
  const int64_t* second = first + P;
  at::Tensor diff = at::empty({P, 3}, coords.options());
  at::Tensor dist = at::empty({P}, coords.options());
  AT_DISPATCH_FLOATING_TYPES(coords.scalar_type(), "pair_vectors_cpu", [&] {
    const at::Tensor x_c = coords.contiguous();
    const scalar_t* x = x_c.data_ptr<scalar_t>();
    at::Tensor img_c, cell_c;
    const scalar_t* img = nullptr;
    const scalar_t* C = nullptr;
    if (cell.has_value()) {
      img_c = images->contiguous();
      cell_c = cell->contiguous();
      img = img_c.data_ptr<scalar_t>();
      C = cell_c.data_ptr<scalar_t>();
    }
    scalar_t* d = diff.data_ptr<scalar_t>();
    scalar_t* r = dist.data_ptr<scalar_t>();
    torchani_fast::parallel_for(0, P, 16384, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const scalar_t* xi = x + 3 * first[p];
        const scalar_t* xj = x + 3 * second[p];
        scalar_t v[3] = {xi[0] - xj[0], xi[1] - xj[1], xi[2] - xj[2]};
        if (C != nullptr) {
          const scalar_t* n = img + 3 * p;
          for (int c = 0; c < 3; ++c) v[c] += n[0] * C[c] + n[1] * C[3 + c] + n[2] * C[6 + c];
        }
        d[3 * p] = v[0];
        d[3 * p + 1] = v[1];
        d[3 * p + 2] = v[2];
        r[p] = std::sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
      }
    });
  });
  return {diff, dist};
}

at::Tensor pair_vectors_backward_cpu(const at::Tensor& grad, const at::Tensor& pairs,
                                     int64_t num_atoms) {
  const char* op = "torchani_fast::pair_vectors_backward";
  TORCH_CHECK(num_atoms >= 0, op, ": num_atoms must be >= 0, got ", num_atoms);
  const at::Tensor idx = checked_pairs(op, pairs, num_atoms);
  const int64_t P = pairs.size(1);
  TORCH_CHECK(at::isFloatingType(grad.scalar_type()) && grad.sizes() == at::IntArrayRef({P, 3}),
              op, ": grad must be a float (", P, ", 3) tensor, got ", grad.scalar_type(), " ",
              grad.sizes());
  const int64_t* first = idx.data_ptr<int64_t>();
  const int64_t* second = first + P;
  const at::Tensor g = grad.contiguous();
  at::Tensor grad_coords = at::zeros({num_atoms, 3}, grad.options());
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "pair_vectors_backward_cpu", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* out = grad_coords.data_ptr<scalar_t>();
    // Serial: each atom's sum is taken in pair order, the same for any number
    // of threads. The first atom's sum stays in registers while consecutive
    // pairs share it (a neighbour list lists an atom's pairs together), which
    // takes the store-to-load chain through memory out of the loop; the order
    // of every atom's additions is unchanged, so are the bits.
    int64_t cur = -1;
    scalar_t acc[3] = {0, 0, 0};
    for (int64_t p = 0; p < P; ++p) {
      const int64_t a = first[p], b = second[p];
      if (a != cur) {
        if (cur >= 0)
          for (int c = 0; c < 3; ++c) out[3 * cur + c] = acc[c];
        cur = a;
        for (int c = 0; c < 3; ++c) acc[c] = out[3 * a + c];
      }
      for (int c = 0; c < 3; ++c) acc[c] += gp[3 * p + c];
      if (b == cur) {  // an atom paired with its own periodic image
        for (int c = 0; c < 3; ++c) acc[c] -= gp[3 * p + c];
      } else {
        for (int c = 0; c < 3; ++c) out[3 * b + c] -= gp[3 * p + c];
      }
    }
    if (cur >= 0)
      for (int c = 0; c < 3; ++c) out[3 * cur + c] = acc[c];
  });
  return grad_coords;
}

}  // namespace torchani_fast
