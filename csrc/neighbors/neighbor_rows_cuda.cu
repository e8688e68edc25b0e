// CUDA neighbour search in three launches, with no global sort and no memset
// (the default; TORCHANI_FAST_CUDA_NEIGHBORS=old selects neighbors_cuda.cu's
// search, four kernels and three ATen launches). Same grid, ownership rule and
// output as the CPU search.
//
//   search_kernel  one block per molecule: cell inverse, wrapped positions,
//                  extents and grid (as in neighbors_cuda.cu), the bin
//                  histogram (zeroed by the block itself), its scan, the atoms
//                  scattered into the bins and each bin sorted by atom index
//                  (ordered bins). Per molecule it writes an error word and
//                  zeroes the pair total (written, never accumulated across
//                  launches: nothing to memset).
//   walk_kernel    one warp per atom of the batch walks the neighbouring bins
//                  32 candidates at a time: __ballot_sync/__popc give each
//                  accepted partner its slot in the atom's row of kRow slots,
//                  sorted then by (j, image). An atom with more than kRow
//                  partners keeps counting: count > kRow is the row's overflow
//                  flag. The molecule's total is an integer atomic sum.
//   write_kernel   one block per molecule: its first slot (the totals of the
//                  molecules before it), a scan of its atoms' counts, then each
//                  atom copies its row to the output; an overflowed row walks
//                  its bins again, serially (writes, then sorts; the one row
//                  cut by the capacity selects its smallest pairs). Unused
//                  slots get (-1, -1) and a zero image; block 0 writes
//                  num_pairs (or the error code).
//
// The output is the old search's, bit for bit: pairs grouped by their first
// atom in ascending order, each atom's partners in (j, image) order.
// Scaling: search_kernel and write_kernel are one block per molecule, so one
// very large molecule (1e5 atoms) binds them to one SM; the walk, the bulk of
// the work, spreads over the device.
#include "common/cuda_common.cuh"
#include "neighbors/cell_bins.h"
#include "neighbors/neighbor_rows.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

namespace torchani_fast {
namespace {

using cuda::atomic_add_i64;
using cuda::imin;
using neighbors::Axis;

constexpr int kThreads = 256;
constexpr int kWalkThreads = 128;
// Slots of an atom's row (16 bytes each): ANI's 5.2 A cutoff gives ~60
// partners in a liquid, and an atom owns at most all of them; a row that
// overflows costs a second, serial walk in write_kernel.
constexpr int kRow = 64;
// Error bits, as in neighbors_cuda.cu.
constexpr int64_t kErrNonFinite = 1;
constexpr int64_t kErrSingular = 2;
constexpr int64_t kErrThinCell = 4;
// Per molecule: total pairs, error bits, N - (first atom with non-finite
// coords) (0: none), bits of the cell determinant.
constexpr int kMolWords = 4;

struct Grid {
  Axis axis[3];
  double C[9];
};

// A row entry: the partner's index within its molecule and the search image.
struct Entry {
  int32_t j, img[3];
};

// (j, image) order of the output: image = shift[j] - shift[i] - img, so for
// one atom i and one partner j the order of the images is that of -img.
__device__ __forceinline__ bool entry_less(const Entry& a, const Entry& b) {
  if (a.j != b.j) return a.j < b.j;
  for (int c = 0; c < 3; ++c)
    if (a.img[c] != b.img[c]) return a.img[c] > b.img[c];
  return false;
}

__device__ __forceinline__ bool key_less(const int64_t* a, const int64_t* b) {
  for (int k = 0; k < 4; ++k)
    if (a[k] != b[k]) return a[k] < b[k];
  return false;
}

// Exclusive scan of n counts (in place) by one block of kThreads: each thread
// a contiguous chunk; returns the total. `partial` is kThreads+1 shared words.
__device__ int64_t block_exclusive_scan(int64_t* v, int64_t n, int64_t* partial) {
  const int t = threadIdx.x;
  const int64_t chunk = (n + kThreads - 1) / kThreads;
  const int64_t b0 = imin(n, t * chunk), b1 = imin(n, b0 + chunk);
  int64_t s = 0;
  for (int64_t b = b0; b < b1; ++b) s += v[b];
  partial[t] = s;
  __syncthreads();
  if (t == 0) {
    int64_t run = 0;
    for (int k = 0; k < kThreads; ++k) {
      const int64_t c = partial[k];
      partial[k] = run;
      run += c;
    }
    partial[kThreads] = run;
  }
  __syncthreads();
  int64_t run = partial[t];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t c = v[b];
    v[b] = run;
    run += c;
  }
  const int64_t total = partial[kThreads];
  __syncthreads();
  return total;
}

// Calls visit(j, img) for each partner that atom i owns, serially (the
// overflow path of write_kernel).
template <typename Visit>
__device__ void walk_serial(int64_t i, int64_t A, const int64_t* __restrict__ bin_of,
                            const Grid& g, const int64_t* __restrict__ bin_start,
                            const int64_t* __restrict__ bin_atoms, const double* __restrict__ wrapped,
                            double cutoff_sq, Visit&& visit) {
  const int64_t m = i / A;
  int64_t own[3];
  neighbors::split_bin(bin_of[i], g.axis, own);
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
        for (int64_t q = bin_start[bin], qe = bin_start[bin + 1]; q < qe; ++q) {
          const int64_t j = bin_atoms[m * A + q];
          if (!neighbors::owns_pair(i, j, img)) continue;
          double rr = 0;
          for (int c = 0; c < 3; ++c) {
            const double v = xi[c] - wrapped[3 * j + c] - tr[c];
            rr += v * v;
          }
          if (rr <= cutoff_sq) visit(j, img);
        }
      }
}

template <typename scalar_t>
__global__ void search_kernel(const int64_t* __restrict__ species, const scalar_t* __restrict__ coords,
                  int64_t A, int64_t N, const double* __restrict__ cell, const bool* __restrict__ pbc,
                  double cutoff, bool cell_list, int64_t bins_per_mol, double* __restrict__ frac,
                  double* __restrict__ wrapped, int64_t* __restrict__ shift,
                  int64_t* __restrict__ bin_of, int64_t* __restrict__ bin_start,
                  int64_t* __restrict__ bin_fill, int64_t* __restrict__ bin_atoms,
                  Grid* __restrict__ grids, int64_t* __restrict__ row_count,
                  int64_t* __restrict__ mol) {
  __shared__ double C[9], inv[9], span[3];
  __shared__ int periodic[3];
  __shared__ double red_lo[3][kThreads], red_hi[3][kThreads];
  __shared__ int64_t red_count[kThreads + 1], red_bad[kThreads];
  __shared__ int64_t flags, det_bits;
  __shared__ Grid grid;
  const int64_t m = blockIdx.x;
  const int t = threadIdx.x;
  const int64_t first_atom = m * A;
  const int64_t B = bins_per_mol;
  int64_t* my_start = bin_start + m * (B + 1);
  int64_t* my_fill = bin_fill + m * B;
  int64_t* my_atoms = bin_atoms + first_atom;

  if (t == 0) {
    for (int k = 0; k < 9; ++k) C[k] = inv[k] = (k % 4 == 0) ? 1.0 : 0.0;
    for (int a = 0; a < 3; ++a) periodic[a] = 0;
    flags = 0;
    det_bits = 0;
    if (cell != nullptr) {
      for (int k = 0; k < 9; ++k) C[k] = cell[k];
      const double det = neighbors::invert_cell(C, inv);
      if (neighbors::singular_cell(C, det)) {
        flags = kErrSingular;
        det_bits = __double_as_longlong(det);
      }
      for (int a = 0; a < 3; ++a) periodic[a] = pbc[a] ? 1 : 0;
    }
    neighbors::fractional_spans(cutoff, inv, span);
  }
  for (int64_t b = t; b < B; b += kThreads) my_fill[b] = 0;
  __syncthreads();

  double lo[3] = {INFINITY, INFINITY, INFINITY}, hi[3] = {-INFINITY, -INFINITY, -INFINITY};
  int64_t count = 0, bad = 0;
  for (int64_t i = first_atom + t; i < first_atom + A; i += kThreads) {
    bin_of[i] = -1;
    row_count[i] = 0;
    if (species[i] < 0) continue;
    const double x[3] = {static_cast<double>(coords[3 * i]), static_cast<double>(coords[3 * i + 1]),
                         static_cast<double>(coords[3 * i + 2])};
    if (!(isfinite(x[0]) && isfinite(x[1]) && isfinite(x[2]))) {
      bad = bad > N - i ? bad : N - i;
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
  red_bad[t] = bad;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (t < s) {
      for (int a = 0; a < 3; ++a) {
        red_lo[a][t] = fmin(red_lo[a][t], red_lo[a][t + s]);
        red_hi[a][t] = fmax(red_hi[a][t], red_hi[a][t + s]);
      }
      red_count[t] += red_count[t + s];
      red_bad[t] = red_bad[t] > red_bad[t + s] ? red_bad[t] : red_bad[t + s];
    }
    __syncthreads();
  }

  if (t == 0) {
    const int64_t n = red_count[0];
    if (red_bad[0] > 0) flags |= kErrNonFinite;
    for (int k = 0; k < 9; ++k) grid.C[k] = C[k];
    for (int a = 0; a < 3; ++a) grid.axis[a] = Axis{1, 0, 0.0, 1.0, 0};
    if (n > 0 && flags == 0) {
      const double max_bins = 4.0 * static_cast<double>(n) + 27.0;
      const double lo_m[3] = {red_lo[0][0], red_lo[1][0], red_lo[2][0]};
      const double hi_m[3] = {red_hi[0][0], red_hi[1][0], red_hi[2][0]};
      int thin_axis;
      double thin_reach;
      const double visits = neighbors::setup_axes(grid.axis, lo_m, hi_m, periodic, span, cell_list,
                                                  max_bins, &thin_axis, &thin_reach);
      if (thin_axis >= 0 || !(visits <= neighbors::kMaxVisits)) {
        flags |= kErrThinCell;
        for (int a = 0; a < 3; ++a) grid.axis[a] = Axis{1, 0, 0.0, 1.0, 0};
      }
    }
    grids[m] = grid;
    mol[kMolWords * m] = 0;  // (the walk adds the pairs)
    mol[kMolWords * m + 1] = flags;
    mol[kMolWords * m + 2] = red_bad[0];
    mol[kMolWords * m + 3] = det_bits;
  }
  __syncthreads();
  if (flags != 0) return;  // (block-uniform) the write kernel writes no pair at all

  // Ordered bins: histogram, scan, scatter, then each bin sorted by atom.
  for (int64_t i = first_atom + t; i < first_atom + A; i += kThreads) {
    if (species[i] < 0) continue;
    const double* f = frac + 3 * i;
    int64_t b = 0;
    for (int a = 0; a < 3; ++a) {
      const Axis& ax = grid.axis[a];
      const double kf = floor((f[a] - ax.lo) / ax.width);
      const int64_t k = static_cast<int64_t>(fmin(fmax(kf, 0.0), static_cast<double>(ax.nb - 1)));
      b = b * ax.nb + k;
    }
    bin_of[i] = b;
    atomic_add_i64(my_fill + b, 1);
  }
  __syncthreads();
  for (int64_t b = t; b < B; b += kThreads) my_start[b] = my_fill[b];
  __syncthreads();
  const int64_t binned = block_exclusive_scan(my_start, B, red_count);
  if (t == 0) my_start[B] = binned;
  for (int64_t b = t; b < B; b += kThreads) my_fill[b] = 0;
  __syncthreads();
  for (int64_t i = first_atom + t; i < first_atom + A; i += kThreads) {
    const int64_t b = bin_of[i];
    if (b >= 0) my_atoms[my_start[b] + atomic_add_i64(my_fill + b, 1)] = i;
  }
  __syncthreads();
  for (int64_t b = t; b < B; b += kThreads) {
    const int64_t q0 = my_start[b], q1 = my_start[b + 1];
    for (int64_t q = q0 + 1; q < q1; ++q) {
      const int64_t v = my_atoms[q];
      int64_t p = q;
      for (; p > q0 && my_atoms[p - 1] > v; --p) my_atoms[p] = my_atoms[p - 1];
      my_atoms[p] = v;
    }
  }
  __syncthreads();
}

// One warp per atom of the batch: 32 candidates per step, compacted with a ballot.
__global__ void walk_kernel(int64_t N, int64_t A, int64_t bins_per_mol,
                            const int64_t* __restrict__ bin_of, const Grid* __restrict__ grids,
                            const int64_t* __restrict__ bin_start,
                            const int64_t* __restrict__ bin_atoms,
                            const double* __restrict__ wrapped, double cutoff_sq,
                            Entry* __restrict__ rows, int64_t* __restrict__ row_count,
                            int64_t* __restrict__ mol) {
  const int lane = threadIdx.x % cuda::kWarp;
  const unsigned below = (1u << lane) - 1u;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / cuda::kWarp);
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / cuda::kWarp; i < N;
       i += warps) {
    const int64_t gb = bin_of[i];
    if (gb < 0) continue;  // (warp-uniform)
    const int64_t m = i / A, first_atom = m * A;
    const Grid& grid = grids[m];
    const int64_t* my_start = bin_start + m * (bins_per_mol + 1);
    const int64_t* my_atoms = bin_atoms + first_atom;
    int64_t own[3];
    neighbors::split_bin(gb, grid.axis, own);
    const double xi[3] = {wrapped[3 * i], wrapped[3 * i + 1], wrapped[3 * i + 2]};
    Entry* row = rows + i * kRow;
    int64_t n = 0;
    const int64_t r0 = grid.axis[0].reach, r1 = grid.axis[1].reach, r2 = grid.axis[2].reach;
    for (int64_t d0 = -r0; d0 <= r0; ++d0)
      for (int64_t d1 = -r1; d1 <= r1; ++d1)
        for (int64_t d2 = -r2; d2 <= r2; ++d2) {
          const int64_t d[3] = {d0, d1, d2};
          int64_t bin, img[3];
          if (!neighbors::offset_bin(grid.axis, own, d, bin, img)) continue;
          double tr[3];
          neighbors::image_translation(img, grid.C, tr);
          const int64_t qe = my_start[bin + 1];
          for (int64_t q0 = my_start[bin]; q0 < qe; q0 += cuda::kWarp) {
            const int64_t q = q0 + lane;
            bool take = false;
            int64_t j = 0;
            if (q < qe) {
              j = my_atoms[q];
              if (neighbors::owns_pair(i, j, img)) {
                double rr = 0;
                for (int c = 0; c < 3; ++c) {
                  const double v = xi[c] - wrapped[3 * j + c] - tr[c];
                  rr += v * v;
                }
                take = rr <= cutoff_sq;
              }
            }
            const unsigned mask = __ballot_sync(0xffffffffu, take);
            const int64_t slot = n + __popc(mask & below);
            if (take && slot < kRow) {
              Entry e;
              e.j = static_cast<int32_t>(j - first_atom);
              for (int c = 0; c < 3; ++c) e.img[c] = static_cast<int32_t>(img[c]);
              row[slot] = e;
            }
            n += __popc(mask);
          }
        }
    __syncwarp();
    if (lane == 0) {
      row_count[i] = n;
      atomic_add_i64(mol + kMolWords * m, n);  // (integers: the same sum in any order)
      // Insertion sort of the row: canonical whatever the bins' visiting order.
      const int64_t kept = imin(n, kRow);
      for (int64_t s = 1; s < kept; ++s) {
        const Entry e = row[s];
        int64_t p = s;
        for (; p > 0 && entry_less(e, row[p - 1]); --p) row[p] = row[p - 1];
        row[p] = e;
      }
    }
    __syncwarp();
  }
}

template <typename scalar_t>
__device__ __forceinline__ bool pair_less(int64_t ja, const scalar_t* ia, int64_t jb,
                                          const scalar_t* ib) {
  if (ja != jb) return ja < jb;
  for (int a = 0; a < 3; ++a)
    if (ia[a] != ib[a]) return ia[a] < ib[a];
  return false;
}

template <typename scalar_t>
__global__ void write_kernel(int64_t M, int64_t A, const int64_t* __restrict__ mol,
                 const Grid* __restrict__ grids, const int64_t* __restrict__ bin_of,
                 const int64_t* __restrict__ bin_start, const int64_t* __restrict__ bin_atoms,
                 int64_t bins_per_mol, const double* __restrict__ wrapped,
                 const int64_t* __restrict__ shift, double cutoff_sq, const Entry* __restrict__ rows,
                 const int64_t* __restrict__ row_count, int64_t* __restrict__ row_start,
                 int64_t capacity, int64_t* __restrict__ pairs, scalar_t* __restrict__ images,
                 int64_t* __restrict__ num_pairs) {
  __shared__ int64_t red_total[kThreads + 1], red_before[kThreads], red_flags[kThreads];
  const int64_t m = blockIdx.x;
  const int t = threadIdx.x;
  // Every block reduces the molecules' words: the total, the pairs of the
  // molecules before this one (its first slot) and the error bits.
  int64_t total = 0, before = 0, flags = 0;
  for (int64_t k = t; k < M; k += kThreads) {
    total += mol[kMolWords * k];
    if (k < m) before += mol[kMolWords * k];
    flags |= mol[kMolWords * k + 1];
  }
  red_total[t] = total;
  red_before[t] = before;
  red_flags[t] = flags;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (t < s) {
      red_total[t] += red_total[t + s];
      red_before[t] += red_before[t + s];
      red_flags[t] |= red_flags[t + s];
    }
    __syncthreads();
  }
  total = red_total[0];
  before = red_before[0];
  flags = red_flags[0];
  __syncthreads();
  if (m == 0 && t == 0 && num_pairs != nullptr)
    *num_pairs = (flags & kErrSingular) ? -2 : (flags & kErrNonFinite) ? -1
                 : (flags & kErrThinCell) ? -3 : total;

  if (flags == 0 && m < M && before < capacity) {  // (block-uniform)
    const int64_t first_atom = m * A;
    int64_t* start = row_start + first_atom;
    for (int64_t k = t; k < A; k += kThreads) start[k] = row_count[first_atom + k];
    __syncthreads();
    block_exclusive_scan(start, A, red_total);
    const Grid& g = grids[m];
    const int64_t* mol_start = bin_start + m * (bins_per_mol + 1);
    for (int64_t k = t; k < A; k += kThreads) {
      const int64_t i = first_atom + k;
      const int64_t n = row_count[i];
      const int64_t first = before + start[k];
      if (n == 0 || first >= capacity) continue;
      const int64_t last = imin(first + n, capacity);
      const int64_t* si = shift + 3 * i;
      if (n <= kRow) {
        const Entry* row = rows + i * kRow;
        for (int64_t s = first; s < last; ++s) {
          const Entry& e = row[s - first];
          const int64_t j = first_atom + e.j;
          pairs[s] = i;
          pairs[capacity + s] = j;
          // x'[i] - (x'[j] + img @ C) with x' = x - shift @ C gives
          // x[i] - x[j] + (shift[j] - shift[i] - img) @ C.
          for (int a = 0; a < 3; ++a)
            images[3 * s + a] = static_cast<scalar_t>(shift[3 * j + a] - si[a] - e.img[a]);
        }
      } else if (last - first == n) {  // an overflowed row: walk again, then sort
        int64_t s = first;
        walk_serial(i, A, bin_of, g, mol_start, bin_atoms, wrapped, cutoff_sq,
                    [&](int64_t j, const int64_t* img) {
                      if (s >= last) return;  // cannot happen: the search's walk
                      pairs[s] = i;
                      pairs[capacity + s] = j;
                      for (int a = 0; a < 3; ++a)
                        images[3 * s + a] = static_cast<scalar_t>(shift[3 * j + a] - si[a] - img[a]);
                      ++s;
                    });
        for (int64_t s1 = first + 1; s1 < last; ++s1) {
          const int64_t j = pairs[capacity + s1];
          const scalar_t im[3] = {images[3 * s1], images[3 * s1 + 1], images[3 * s1 + 2]};
          int64_t q = s1;
          while (q > first && pair_less(j, im, pairs[capacity + q - 1], images + 3 * (q - 1))) {
            pairs[capacity + q] = pairs[capacity + q - 1];
            for (int a = 0; a < 3; ++a) images[3 * q + a] = images[3 * (q - 1) + a];
            --q;
          }
          pairs[capacity + q] = j;
          for (int a = 0; a < 3; ++a) images[3 * q + a] = im[a];
        }
      } else {
        // The overflowed row cut by the capacity keeps its smallest pairs in
        // (j, image) order, by repeated selection (one walk per slot).
        int64_t prev[4] = {-1, INT64_MIN, INT64_MIN, INT64_MIN};
        for (int64_t s = first; s < last; ++s) {
          int64_t best[4] = {INT64_MAX, 0, 0, 0};
          walk_serial(i, A, bin_of, g, mol_start, bin_atoms, wrapped, cutoff_sq,
                      [&](int64_t j, const int64_t* img) {
                        int64_t cand[4] = {j, 0, 0, 0};
                        for (int a = 0; a < 3; ++a) cand[1 + a] = shift[3 * j + a] - si[a] - img[a];
                        if (key_less(prev, cand) && key_less(cand, best))
                          for (int a = 0; a < 4; ++a) best[a] = cand[a];
                      });
          pairs[s] = i;
          pairs[capacity + s] = best[0];
          for (int a = 0; a < 3; ++a) images[3 * s + a] = static_cast<scalar_t>(best[1 + a]);
          for (int a = 0; a < 4; ++a) prev[a] = best[a];
        }
      }
    }
  }
  // Unused slots of a fixed-capacity list: (-1, -1) with a zero image.
  const int64_t used = flags == 0 ? imin(total, capacity) : 0;
  for (int64_t s = used + m * kThreads + t; s < capacity; s += int64_t(gridDim.x) * kThreads) {
    pairs[s] = -1;
    pairs[capacity + s] = -1;
    for (int a = 0; a < 3; ++a) images[3 * s + a] = scalar_t(0);
  }
}

struct RowSearch {
  int64_t M, A, N, B;
  double cutoff_sq;
  at::Tensor species, coords, frac, wrapped, shift, bin_of, bin_start, bin_fill, bin_atoms, grids,
      rows, row_count, row_start, mol;
};

RowSearch row_search(const char* op, const at::Tensor& species, const at::Tensor& coords,
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
  RowSearch s;
  s.M = species.size(0);
  s.A = species.size(1);
  s.N = s.M * s.A;
  s.B = 4 * s.A + 27;
  s.cutoff_sq = cutoff * cutoff;
  s.species = species.to(at::kLong).contiguous();
  s.coords = coords.detach().contiguous();
  const auto dopt = coords.options().dtype(at::kDouble);
  const auto lopt = coords.options().dtype(at::kLong);
  const auto bopt = coords.options().dtype(at::kByte);
  const int64_t N = s.N, M = s.M;
  // Nothing is zeroed here: each block initialises what it reads.
  s.frac = at::empty({N, 3}, dopt);
  s.wrapped = at::empty({N, 3}, dopt);
  s.shift = at::empty({N, 3}, lopt);
  s.bin_of = at::empty({N}, lopt);
  s.bin_atoms = at::empty({N}, lopt);
  s.bin_start = at::empty({M * (s.B + 1)}, lopt);
  s.bin_fill = at::empty({M * s.B}, lopt);
  s.grids = at::empty({M * static_cast<int64_t>(sizeof(Grid))}, bopt);
  s.rows = at::empty({N * kRow * static_cast<int64_t>(sizeof(Entry))}, bopt);
  s.row_count = at::empty({N}, lopt);
  s.row_start = at::empty({N}, lopt);
  // Written by the search's blocks; zeros only when there is no search.
  s.mol = M > 0 && s.A > 0 ? at::empty({M * kMolWords}, lopt) : at::zeros({M * kMolWords}, lopt);
  if (M > 0 && s.A > 0) {
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(s.coords.scalar_type(), "neighbor_rows_search", [&] {
      search_kernel<scalar_t><<<static_cast<unsigned int>(M), kThreads, 0, stream>>>(
          s.species.data_ptr<int64_t>(), s.coords.data_ptr<scalar_t>(), s.A, N,
          cell.has_value() ? cell_d.data_ptr<double>() : nullptr,
          cell.has_value() ? pbc_d.data_ptr<bool>() : nullptr, cutoff, cell_list, s.B,
          s.frac.data_ptr<double>(), s.wrapped.data_ptr<double>(), s.shift.data_ptr<int64_t>(),
          s.bin_of.data_ptr<int64_t>(), s.bin_start.data_ptr<int64_t>(),
          s.bin_fill.data_ptr<int64_t>(), s.bin_atoms.data_ptr<int64_t>(),
          reinterpret_cast<Grid*>(s.grids.data_ptr<uint8_t>()), s.row_count.data_ptr<int64_t>(),
          s.mol.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    walk_kernel<<<cuda::grid_for(N * cuda::kWarp, kWalkThreads), kWalkThreads, 0, stream>>>(
        N, s.A, s.B, s.bin_of.data_ptr<int64_t>(),
        reinterpret_cast<const Grid*>(s.grids.data_ptr<uint8_t>()),
        s.bin_start.data_ptr<int64_t>(), s.bin_atoms.data_ptr<int64_t>(),
        s.wrapped.data_ptr<double>(), s.cutoff_sq,
        reinterpret_cast<Entry*>(s.rows.data_ptr<uint8_t>()), s.row_count.data_ptr<int64_t>(),
        s.mol.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return s;
}

void launch_write(const RowSearch& s, int64_t capacity, at::Tensor& pairs, at::Tensor& images,
                  int64_t* num_pairs) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = std::max<int64_t>(s.M, 1);
  AT_DISPATCH_FLOATING_TYPES(s.coords.scalar_type(), "neighbor_rows_write", [&] {
    write_kernel<scalar_t><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
        s.M, s.A, s.mol.data_ptr<int64_t>(), reinterpret_cast<const Grid*>(s.grids.data_ptr<uint8_t>()),
        s.bin_of.data_ptr<int64_t>(), s.bin_start.data_ptr<int64_t>(),
        s.bin_atoms.data_ptr<int64_t>(), s.B, s.wrapped.data_ptr<double>(),
        s.shift.data_ptr<int64_t>(), s.cutoff_sq,
        reinterpret_cast<const Entry*>(s.rows.data_ptr<uint8_t>()), s.row_count.data_ptr<int64_t>(),
        s.row_start.data_ptr<int64_t>(), capacity, pairs.data_ptr<int64_t>(),
        images.data_ptr<scalar_t>(), num_pairs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

// Read at every call, so that one process can time both searches.
bool use_row_neighbors() {
  const char* v = std::getenv("TORCHANI_FAST_CUDA_NEIGHBORS");
  const std::string s = v == nullptr ? "" : v;
  TORCH_CHECK(s.empty() || s == "new" || s == "old",
              "TORCHANI_FAST_CUDA_NEIGHBORS must be 'new' or 'old' (or unset: new), got '", s, "'");
  return s != "old";
}

std::tuple<at::Tensor, at::Tensor> neighbor_pairs_rows_cuda(const at::Tensor& species,
                                                            const at::Tensor& coords,
                                                            const c10::optional<at::Tensor>& cell,
                                                            const c10::optional<at::Tensor>& pbc,
                                                            double cutoff, bool cell_list) {
  const char* op = "torchani_fast::neighbor_pairs";
  c10::cuda::CUDAGuard guard(coords.device());
  RowSearch s = row_search(op, species, coords, cell, pbc, cutoff, cell_list);
  // The number of pairs decides the output shape: this copy of the molecules'
  // words is the op's one host synchronisation.
  const auto host = s.mol.to(at::kCPU);
  const int64_t* h = host.data_ptr<int64_t>();
  int64_t total = 0, flags = 0, bad = 0, det_bits = 0;
  for (int64_t m = 0; m < s.M; ++m) {
    total += h[kMolWords * m];
    flags |= h[kMolWords * m + 1];
    bad = std::max(bad, h[kMolWords * m + 2]);
    if (h[kMolWords * m + 1] & kErrSingular) det_bits = h[kMolWords * m + 3];
  }
  if (flags & kErrSingular) {
    double det;
    std::memcpy(&det, &det_bits, sizeof det);
    TORCH_CHECK(false, op, ": cell is singular (determinant ", det, "), got cell ",
                cell->detach().cpu());
  }
  if (flags & kErrNonFinite) {
    const int64_t i = s.N - bad;
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> neighbor_pairs_padded_rows_cuda(
    const at::Tensor& species, const at::Tensor& coords, const c10::optional<at::Tensor>& cell,
    const c10::optional<at::Tensor>& pbc, double cutoff, bool cell_list, int64_t max_pairs) {
  const char* op = "torchani_fast::neighbor_pairs_padded";
  TORCH_CHECK(max_pairs >= 0, op, ": max_pairs must be >= 0, got ", max_pairs);
  c10::cuda::CUDAGuard guard(coords.device());
  RowSearch s = row_search(op, species, coords, cell, pbc, cutoff, cell_list);
  auto pairs = at::empty({2, max_pairs}, s.species.options());
  auto images = at::empty({max_pairs, 3}, s.coords.options());
  auto num_pairs = at::empty({}, s.species.options());
  launch_write(s, max_pairs, pairs, images, num_pairs.data_ptr<int64_t>());
  return {pairs, images, num_pairs};
}

}  // namespace torchani_fast
