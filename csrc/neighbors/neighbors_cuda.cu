// CUDA neighbour search: the CPU algorithm (neighbors/neighbors_cpu.cpp) on the device.
// The older search (4 kernels + 3 ATen launches), kept for A/B runs behind
// TORCHANI_FAST_CUDA_NEIGHBORS=old; the default is the three-launch one of
// neighbors/neighbor_rows_cuda.cu.
//
// Same grid as on the CPU, built without the host: every quantity that decides
// a size is bounded by input shapes, so nothing is read back in the default
// path. Per molecule m the grid has at most B = 4*A + 27 bins (the CPU keeps
// nbins <= 4*count + 27), which fixes every buffer size in advance.
//
//   setup_kernel    one block per molecule: cell inverse, wrapped positions,
//                   extents, the grid, each atom's bin and the bin histogram
//   cumsum          bin starts (at::cumsum, on the stream, no sync)
//   scatter_kernel  atoms into bins
//   count_kernel    pairs owned by each atom i (partners j >= i, as on the CPU)
//   cumsum          each atom's first output slot; the total is pair_start[N]
//   write_kernel    pairs in atom order; each atom sorts its own slots by
//                   (j, image) so the output does not depend on the order
//                   atomics filled the bins; padding slots get -1
//
// neighbor_pairs_padded_cuda stops there: fixed-size outputs plus the count on
// the device, so a CUDA graph can capture it. neighbor_pairs_cuda (the
// data-dependent op) reads the count back once, which is its only host sync,
// and also reports the errors that the padded op can only encode in the count.
#include "common/cuda_common.cuh"
#include "neighbors/cell_bins.h"
#include "neighbors/neighbor_rows.h"
#include "ops.h"

#include <cmath>

namespace torchani_fast {
namespace {

using cuda::atomic_add_i64;
using cuda::atomic_max_i64;
using cuda::atomic_or_i64;
using cuda::imax;
using cuda::imin;

constexpr int kSetupThreads = 256;
constexpr int kThreads = 128;
// Error bits in err[0]; err[1] = N - (first atom with non-finite coords);
// err[2] = bits of the cell determinant.
constexpr int64_t kErrNonFinite = 1;
constexpr int64_t kErrSingular = 2;
constexpr int64_t kErrThinCell = 4;

using neighbors::Axis;

struct Grid {
  Axis axis[3];
  double C[9];  // cell rows (identity without a cell)
};

template <typename scalar_t>
__global__ void setup_kernel(const int64_t* __restrict__ species,
                             const scalar_t* __restrict__ coords, int64_t A, int64_t N,
                             const double* __restrict__ cell, const bool* __restrict__ pbc,
                             double cutoff, bool cell_list, int64_t bins_per_mol,
                             double* __restrict__ frac, double* __restrict__ wrapped,
                             int64_t* __restrict__ shift, int64_t* __restrict__ bin_of,
                             Grid* __restrict__ grids, int64_t* __restrict__ bin_count,
                             int64_t* __restrict__ err) {
  __shared__ double C[9], inv[9], span[3];
  __shared__ int periodic[3];
  __shared__ bool singular;
  __shared__ double red_lo[3][kSetupThreads], red_hi[3][kSetupThreads];
  __shared__ int64_t red_count[kSetupThreads];
  __shared__ Grid grid;
  const int64_t m = blockIdx.x;
  const int t = threadIdx.x;

  if (t == 0) {
    for (int k = 0; k < 9; ++k) C[k] = inv[k] = (k % 4 == 0) ? 1.0 : 0.0;
    for (int a = 0; a < 3; ++a) periodic[a] = 0;
    singular = false;
    if (cell != nullptr) {
      for (int k = 0; k < 9; ++k) C[k] = cell[k];
      const double det = neighbors::invert_cell(C, inv);
      singular = neighbors::singular_cell(C, det);
      if (singular && m == 0) {
        atomic_or_i64(err, kErrSingular);
        err[2] = __double_as_longlong(det);
      }
      for (int a = 0; a < 3; ++a) periodic[a] = pbc[a] ? 1 : 0;
    }
    neighbors::fractional_spans(cutoff, inv, span);
  }
  __syncthreads();

  double lo[3] = {INFINITY, INFINITY, INFINITY}, hi[3] = {-INFINITY, -INFINITY, -INFINITY};
  int64_t count = 0;
  for (int64_t i = m * A + t; i < (m + 1) * A; i += blockDim.x) {
    bin_of[i] = -1;
    if (species[i] < 0) continue;
    const double x[3] = {static_cast<double>(coords[3 * i]), static_cast<double>(coords[3 * i + 1]),
                         static_cast<double>(coords[3 * i + 2])};
    if (!(isfinite(x[0]) && isfinite(x[1]) && isfinite(x[2]))) {
      atomic_or_i64(err, kErrNonFinite);
      atomic_max_i64(err + 1, N - i);
      for (int a = 0; a < 3; ++a) frac[3 * i + a] = NAN;
      continue;
    }
    ++count;
    for (int a = 0; a < 3; ++a) {
      double f = x[0] * inv[a] + x[1] * inv[3 + a] + x[2] * inv[6 + a];
      int64_t k = 0;
      if (periodic[a]) {
        const double fk = neighbors::wrap_unit(f);
        k = isfinite(fk) ? static_cast<int64_t>(fk) : 0;
      }
      shift[3 * i + a] = k;
      frac[3 * i + a] = f;
      lo[a] = fmin(lo[a], f);
      hi[a] = fmax(hi[a], f);
    }
    neighbors::to_cartesian(frac + 3 * i, C, wrapped + 3 * i);
  }
  for (int a = 0; a < 3; ++a) {
    red_lo[a][t] = lo[a];
    red_hi[a][t] = hi[a];
  }
  red_count[t] = count;
  __syncthreads();
  for (int s = kSetupThreads / 2; s > 0; s /= 2) {
    if (t < s) {
      for (int a = 0; a < 3; ++a) {
        red_lo[a][t] = fmin(red_lo[a][t], red_lo[a][t + s]);
        red_hi[a][t] = fmax(red_hi[a][t], red_hi[a][t + s]);
      }
      red_count[t] += red_count[t + s];
    }
    __syncthreads();
  }

  if (t == 0) {
    const int64_t n = red_count[0];
    for (int k = 0; k < 9; ++k) grid.C[k] = C[k];
    if (n == 0 || singular) {
      for (int a = 0; a < 3; ++a) grid.axis[a] = Axis{1, 0, 0.0, 1.0, 0};
    } else {
      // Keep the grid no larger than a few bins per atom (sparse or elongated
      // systems); counted in double so that no product can overflow.
      const double max_bins = 4.0 * static_cast<double>(n) + 27.0;
      const double lo_m[3] = {red_lo[0][0], red_lo[1][0], red_lo[2][0]};
      const double hi_m[3] = {red_hi[0][0], red_hi[1][0], red_hi[2][0]};
      int thin_axis;
      double thin_reach;
      const double visits = neighbors::setup_axes(grid.axis, lo_m, hi_m, periodic, span, cell_list,
                                                  max_bins, &thin_axis, &thin_reach);
      const bool thin = thin_axis >= 0 || !(visits <= neighbors::kMaxVisits);
      if (thin) {  // the CPU raises; here: flag it and search nothing
        atomic_or_i64(err, kErrThinCell);
        for (int a = 0; a < 3; ++a) grid.axis[a] = Axis{1, 0, 0.0, 1.0, 0};
      }
    }
    grids[m] = grid;
  }
  __syncthreads();
  if (singular) return;
  for (int64_t i = m * A + t; i < (m + 1) * A; i += blockDim.x) {
    if (species[i] < 0) continue;
    const double* f = frac + 3 * i;
    if (!(isfinite(f[0]) && isfinite(f[1]) && isfinite(f[2]))) continue;
    int64_t b = 0;
    for (int a = 0; a < 3; ++a) {
      const Axis& ax = grid.axis[a];
      const double kf = floor((f[a] - ax.lo) / ax.width);
      const int64_t k = static_cast<int64_t>(fmin(fmax(kf, 0.0), static_cast<double>(ax.nb - 1)));
      b = b * ax.nb + k;
    }
    bin_of[i] = m * bins_per_mol + b;
    atomic_add_i64(bin_count + m * bins_per_mol + b, 1);
  }
}

__global__ void scatter_kernel(int64_t N, const int64_t* __restrict__ bin_of,
                               const int64_t* __restrict__ bin_start, int64_t* __restrict__ cursor,
                               int64_t* __restrict__ bin_atoms) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = bin_of[i];
    if (b < 0) continue;
    bin_atoms[bin_start[b] + atomic_add_i64(cursor + b, 1)] = i;
  }
}

// Calls visit(j, img) for every partner j of atom i that i owns (j > i, or
// j == i with a "positive" image), exactly as the CPU loop does.
template <typename Visit>
__device__ void for_each_partner(int64_t i, int64_t A, int64_t bins_per_mol,
                                 const int64_t* __restrict__ bin_of, const Grid* __restrict__ grids,
                                 const int64_t* __restrict__ bin_start,
                                 const int64_t* __restrict__ bin_atoms,
                                 const double* __restrict__ wrapped, double cutoff_sq,
                                 Visit&& visit) {
  const int64_t gb = bin_of[i];
  if (gb < 0) return;
  const int64_t m = i / A;
  const Grid& g = grids[m];
  const int64_t base = m * bins_per_mol;
  int64_t own[3];
  neighbors::split_bin(gb - base, g.axis, own);
  const double xi[3] = {wrapped[3 * i], wrapped[3 * i + 1], wrapped[3 * i + 2]};
  const int64_t r0 = g.axis[0].reach, r1 = g.axis[1].reach, r2 = g.axis[2].reach;
  for (int64_t d0 = -r0; d0 <= r0; ++d0)
    for (int64_t d1 = -r1; d1 <= r1; ++d1)
      for (int64_t d2 = -r2; d2 <= r2; ++d2) {
        const int64_t d[3] = {d0, d1, d2};
        int64_t bin, img[3];
        if (!neighbors::offset_bin(g.axis, own, d, bin, img)) continue;
        double tr[3];
        neighbors::image_translation(img, g.C, tr);
        const int64_t qe = bin_start[base + bin + 1];
        for (int64_t q = bin_start[base + bin]; q < qe; ++q) {
          const int64_t j = bin_atoms[q];
          if (!neighbors::owns_pair(i, j, img)) continue;
          double rr = 0;
          for (int c = 0; c < 3; ++c) {
            const double v = xi[c] - wrapped[3 * j + c] - tr[c];
            rr += v * v;
          }
          if (rr > cutoff_sq) continue;
          visit(j, img);
        }
      }
}

__global__ void count_kernel(int64_t N, int64_t A, int64_t bins_per_mol,
                             const int64_t* __restrict__ bin_of, const Grid* __restrict__ grids,
                             const int64_t* __restrict__ bin_start,
                             const int64_t* __restrict__ bin_atoms,
                             const double* __restrict__ wrapped, double cutoff_sq,
                             const int64_t* __restrict__ err, int64_t* __restrict__ pair_count) {
  const bool failed = err[0] != 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = 0;
    if (!failed)
      for_each_partner(i, A, bins_per_mol, bin_of, grids, bin_start, bin_atoms, wrapped, cutoff_sq,
                       [&](int64_t, const int64_t*) { ++n; });
    pair_count[i] = n;
  }
}

// (j, image) lexicographic order, the canonical order of one atom's pairs.
template <typename scalar_t>
__device__ __forceinline__ bool pair_less(int64_t ja, const scalar_t* ia, int64_t jb,
                                          const scalar_t* ib) {
  if (ja != jb) return ja < jb;
  for (int a = 0; a < 3; ++a)
    if (ia[a] != ib[a]) return ia[a] < ib[a];
  return false;
}

__device__ __forceinline__ bool key_less(const int64_t* a, const int64_t* b) {
  for (int k = 0; k < 4; ++k)
    if (a[k] != b[k]) return a[k] < b[k];
  return false;
}

template <typename scalar_t>
__global__ void write_kernel(int64_t N, int64_t A, int64_t bins_per_mol,
                             const int64_t* __restrict__ bin_of, const Grid* __restrict__ grids,
                             const int64_t* __restrict__ bin_start,
                             const int64_t* __restrict__ bin_atoms,
                             const double* __restrict__ wrapped, const int64_t* __restrict__ shift,
                             double cutoff_sq, const int64_t* __restrict__ err,
                             const int64_t* __restrict__ pair_start, int64_t capacity,
                             int64_t* __restrict__ pairs, scalar_t* __restrict__ images,
                             int64_t* __restrict__ num_pairs) {
  const int64_t flags = err[0];
  const int64_t total = pair_start[N];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (tid == 0 && num_pairs != nullptr)
    *num_pairs = (flags & kErrSingular) ? -2 : (flags & kErrNonFinite) ? -1
                 : (flags & kErrThinCell) ? -3 : total;
  if (flags == 0) {
    for (int64_t i = tid; i < N; i += stride) {
      const int64_t first = pair_start[i];
      if (first >= capacity) continue;
      const int64_t last = imin(pair_start[i + 1], capacity);
      if (last < pair_start[i + 1]) {
        // The one atom cut by an overflow keeps its smallest pairs in (j,
        // image) order, found by repeated selection (k passes over its tens of
        // partners), so the cut does not depend on the order of the bins.
        int64_t prev[4] = {-1, INT64_MIN, INT64_MIN, INT64_MIN};
        for (int64_t slot = first; slot < last; ++slot) {
          int64_t best[4] = {INT64_MAX, 0, 0, 0};
          for_each_partner(i, A, bins_per_mol, bin_of, grids, bin_start, bin_atoms, wrapped,
                           cutoff_sq, [&](int64_t j, const int64_t* img) {
                             int64_t cand[4] = {j, 0, 0, 0};
                             for (int a = 0; a < 3; ++a)
                               cand[1 + a] = shift[3 * j + a] - shift[3 * i + a] - img[a];
                             if (key_less(prev, cand) && key_less(cand, best))
                               for (int a = 0; a < 4; ++a) best[a] = cand[a];
                           });
          pairs[slot] = i;
          pairs[capacity + slot] = best[0];
          for (int a = 0; a < 3; ++a) images[3 * slot + a] = static_cast<scalar_t>(best[1 + a]);
          for (int a = 0; a < 4; ++a) prev[a] = best[a];
        }
        continue;
      }
      int64_t slot = first;
      for_each_partner(i, A, bins_per_mol, bin_of, grids, bin_start, bin_atoms, wrapped, cutoff_sq,
                       [&](int64_t j, const int64_t* img) {
                         if (slot >= last) return;  // cannot happen: same walk as count_kernel
                         pairs[slot] = i;
                         pairs[capacity + slot] = j;
                         // x'[i] - (x'[j] + img @ C) with x' = x - shift @ C gives
                         // x[i] - x[j] + (shift[j] - shift[i] - img) @ C.
                         for (int a = 0; a < 3; ++a)
                           images[3 * slot + a] = static_cast<scalar_t>(
                               shift[3 * j + a] - shift[3 * i + a] - img[a]);
                         ++slot;
                       });
      // Insertion sort of this atom's few slots (tens: the neighbours within
      // the cutoff), so that the output is canonical.
      for (int64_t s = first + 1; s < last; ++s) {
        const int64_t j = pairs[capacity + s];
        const scalar_t im[3] = {images[3 * s], images[3 * s + 1], images[3 * s + 2]};
        int64_t q = s;
        while (q > first && pair_less(j, im, pairs[capacity + q - 1], images + 3 * (q - 1))) {
          pairs[capacity + q] = pairs[capacity + q - 1];
          for (int a = 0; a < 3; ++a) images[3 * q + a] = images[3 * (q - 1) + a];
          --q;
        }
        pairs[capacity + q] = j;
        for (int a = 0; a < 3; ++a) images[3 * q + a] = im[a];
      }
    }
  }
  // Unused slots of a fixed-capacity list: (-1, -1) with a zero image.
  const int64_t used = flags == 0 ? imin(total, capacity) : 0;
  for (int64_t s = used + tid; s < capacity; s += stride) {
    pairs[s] = -1;
    pairs[capacity + s] = -1;
    for (int a = 0; a < 3; ++a) images[3 * s + a] = scalar_t(0);
  }
}

// Everything up to and including the pair counts; write_kernel is launched by
// the two entry points with their own capacity.
struct Search {
  int64_t M, A, N, bins_per_mol;
  double cutoff_sq;
  at::Tensor species, coords, frac, wrapped, shift, bin_of, grids, bin_atoms, ints;
  // Views into `ints` (one zero-filled allocation, one memset).
  at::Tensor bin_count, bin_start, cursor, pair_count, pair_start, err;
};

Search run_search(const char* op, const at::Tensor& species, const at::Tensor& coords,
                  const c10::optional<at::Tensor>& cell, const c10::optional<at::Tensor>& pbc,
                  double cutoff, bool cell_list) {
  check_neighbor_inputs(op, species, coords, cell, pbc, cutoff);
  const at::Device device = coords.device();
  cuda::check_same_device(op, "species", species, device);
  at::Tensor cell_d, pbc_d;
  if (cell.has_value()) {
    cuda::check_same_device(op, "cell", *cell, device);
    cuda::check_same_device(op, "pbc", *pbc, device);
    cell_d = cell->detach().to(at::kDouble).contiguous();
    pbc_d = pbc->contiguous();
  }
  Search s;
  s.M = species.size(0);
  s.A = species.size(1);
  s.N = s.M * s.A;
  s.bins_per_mol = 4 * s.A + 27;
  s.cutoff_sq = cutoff * cutoff;
  s.species = species.to(at::kLong).contiguous();
  s.coords = coords.detach().contiguous();
  const auto dopt = coords.options().dtype(at::kDouble);
  const auto lopt = coords.options().dtype(at::kLong);
  const int64_t N = s.N, MB = s.M * s.bins_per_mol;
  s.frac = at::empty({N, 3}, dopt);
  s.wrapped = at::empty({N, 3}, dopt);
  s.shift = at::empty({N, 3}, lopt);
  s.bin_of = at::empty({N}, lopt);
  s.bin_atoms = at::empty({N > 0 ? N : 1}, lopt);
  s.grids = at::empty({s.M * static_cast<int64_t>(sizeof(Grid))}, coords.options().dtype(at::kByte));
  // Layout: bin_count | bin_start | cursor | pair_count | pair_start | err, so
  // that pair_start[N] and err[0..2] are adjacent and come back in one copy.
  s.ints = at::zeros({MB + (MB + 1) + MB + N + (N + 1) + 3}, lopt);
  int64_t off = 0;
  auto take = [&](int64_t n) {
    auto v = s.ints.narrow(0, off, n);
    off += n;
    return v;
  };
  s.bin_count = take(MB);
  s.bin_start = take(MB + 1);
  s.cursor = take(MB);
  s.pair_count = take(N);
  s.pair_start = take(N + 1);
  s.err = take(3);

  auto stream = at::cuda::getCurrentCUDAStream();
  if (s.M > 0 && s.A > 0) {
    AT_DISPATCH_FLOATING_TYPES(s.coords.scalar_type(), "neighbor_pairs_cuda_setup", [&] {
      setup_kernel<scalar_t><<<static_cast<unsigned int>(s.M), kSetupThreads, 0, stream>>>(
          s.species.data_ptr<int64_t>(), s.coords.data_ptr<scalar_t>(), s.A, N,
          cell.has_value() ? cell_d.data_ptr<double>() : nullptr,
          cell.has_value() ? pbc_d.data_ptr<bool>() : nullptr, cutoff, cell_list, s.bins_per_mol,
          s.frac.data_ptr<double>(), s.wrapped.data_ptr<double>(), s.shift.data_ptr<int64_t>(),
          s.bin_of.data_ptr<int64_t>(), reinterpret_cast<Grid*>(s.grids.data_ptr<uint8_t>()),
          s.bin_count.data_ptr<int64_t>(), s.err.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    auto bin_ends = s.bin_start.narrow(0, 1, MB);
    at::cumsum_out(bin_ends, s.bin_count, 0);
    scatter_kernel<<<cuda::grid_for(N, kThreads), kThreads, 0, stream>>>(
        N, s.bin_of.data_ptr<int64_t>(), s.bin_start.data_ptr<int64_t>(),
        s.cursor.data_ptr<int64_t>(), s.bin_atoms.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    count_kernel<<<cuda::grid_for(N, kThreads), kThreads, 0, stream>>>(
        N, s.A, s.bins_per_mol, s.bin_of.data_ptr<int64_t>(),
        reinterpret_cast<const Grid*>(s.grids.data_ptr<uint8_t>()),
        s.bin_start.data_ptr<int64_t>(), s.bin_atoms.data_ptr<int64_t>(),
        s.wrapped.data_ptr<double>(), s.cutoff_sq, s.err.data_ptr<int64_t>(),
        s.pair_count.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto pair_ends = s.pair_start.narrow(0, 1, N);
    at::cumsum_out(pair_ends, s.pair_count, 0);
  }
  return s;
}

void launch_write(const Search& s, int64_t capacity, at::Tensor& pairs, at::Tensor& images,
                  int64_t* num_pairs) {
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(s.coords.scalar_type(), "neighbor_pairs_cuda_write", [&] {
    write_kernel<scalar_t><<<cuda::grid_for(std::max(s.N, capacity), kThreads), kThreads, 0,
                             stream>>>(
        s.N, s.A, s.bins_per_mol, s.bin_of.data_ptr<int64_t>(),
        reinterpret_cast<const Grid*>(s.grids.data_ptr<uint8_t>()),
        s.bin_start.data_ptr<int64_t>(), s.bin_atoms.data_ptr<int64_t>(),
        s.wrapped.data_ptr<double>(), s.shift.data_ptr<int64_t>(), s.cutoff_sq,
        s.err.data_ptr<int64_t>(), s.pair_start.data_ptr<int64_t>(), capacity,
        pairs.data_ptr<int64_t>(), images.data_ptr<scalar_t>(), num_pairs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> neighbor_pairs_cuda(const at::Tensor& species,
                                                       const at::Tensor& coords,
                                                       const c10::optional<at::Tensor>& cell,
                                                       const c10::optional<at::Tensor>& pbc,
                                                       double cutoff, bool cell_list) {
  if (use_row_neighbors())
    return neighbor_pairs_rows_cuda(species, coords, cell, pbc, cutoff, cell_list);
  const char* op = "torchani_fast::neighbor_pairs";
  c10::cuda::CUDAGuard guard(coords.device());
  Search s = run_search(op, species, coords, cell, pbc, cutoff, cell_list);
  // The number of pairs decides the output shape: this copy is the op's one
  // host synchronisation (use neighbor_pairs_padded to avoid it).
  const auto tail = s.ints.narrow(0, s.ints.numel() - 4, 4).to(at::kCPU);
  const int64_t* h = tail.data_ptr<int64_t>();
  const int64_t total = h[0], flags = h[1];
  if (flags & kErrSingular) {
    const double det = *reinterpret_cast<const double*>(&h[3]);
    TORCH_CHECK(false, op, ": cell is singular (determinant ", det, "), got cell ",
                cell->detach().cpu());
  }
  if (flags & kErrNonFinite) {
    const int64_t i = s.N - h[2];
    const auto x = coords[i / s.A][i % s.A].detach().to(at::kCPU, at::kDouble).contiguous();
    const double* v = x.data_ptr<double>();
    TORCH_CHECK(false, op, ": coords must be finite, got (", v[0], ", ", v[1], ", ", v[2],
                ") for atom ", i % s.A, " of molecule ", i / s.A);
  }
  TORCH_CHECK(!(flags & kErrThinCell), op,
              ": the cell is too small for the cutoff: the search around each atom would visit "
              "more than 1e6 periodic images or bins (or 1e5 along one lattice vector)");
  auto pairs = at::empty({2, total}, s.species.options());
  auto images = at::empty({total, 3}, s.coords.options());
  if (total > 0) launch_write(s, total, pairs, images, nullptr);
  return {pairs, images};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_cuda(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs) {
  if (use_row_neighbors())
    return neighbor_pairs_padded_rows_cuda(species, coords, cell, pbc, cutoff, cell_list, max_pairs);
  const char* op = "torchani_fast::neighbor_pairs_padded";
  TORCH_CHECK(max_pairs >= 0, op, ": max_pairs must be >= 0, got ", max_pairs);
  c10::cuda::CUDAGuard guard(coords.device());
  Search s = run_search(op, species, coords, cell, pbc, cutoff, cell_list);
  auto pairs = at::empty({2, max_pairs}, s.species.options());
  auto images = at::empty({max_pairs, 3}, s.coords.options());
  auto num_pairs = at::empty({}, s.species.options());
  launch_write(s, max_pairs, pairs, images, num_pairs.data_ptr<int64_t>());
  return {pairs, images, num_pairs};
}

}  // namespace torchani_fast
