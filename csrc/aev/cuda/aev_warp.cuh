// The warp-cooperative CUDA AEV (the default; TORCHANI_FAST_CUDA_AEV=old selects
// the kernels of aev_cuda.cu): the lanes of a warp share an atom's radial
// neighbours and its angular triples instead of its AEV columns. Included by
// aev_cuda.cu only.
//
//   slot_fill_kernel      thread per pair: keep? (as edge_count_kernel), then
//                         each half edge takes a slot of its atom's
//                         fixed-capacity list (kMaxSlots); an atom with more
//                         half edges sets kErrOverflow
//   warp_forward_kernel   one warp (= one block) per atom at a time: stage the
//                         atom's half edges in shared memory, rank-sorted into
//                         the canonical order (angular first, then pair and
//                         side); lane t takes radial neighbour / triple t of a
//                         round of 32 and writes its terms into its own
//                         scratch row; then lane f sums column f over t = 0..31
//                         in order into the shared AEV row
//   warp_backward_kernel  the same rounds: a lane sums over the columns of its
//                         own triple (no shuffles), writes the triple's two
//                         half-edge gradients into its scratch row, and the lane
//                         that owns a half edge adds them in triple order
//   pair_gather_kernel    thread per pair: grad_diff = g[side 1] - g[side 0]
//
// No float atomics and a fixed order for every sum: the same bits on every run
// and for every grid size. Launches: forward 2 kernels (fill, AEV) after one
// memset; backward 2 (AEV backward, gather) when it gets the forward's slots
// (aev_with_edges), 4 otherwise.
//
// Device errors without a host sync, as the old kernels: a species outside
// [-1, num_species) gives that atom a NaN row, a pair index >= M*A the whole
// AEV NaN and a zero gradient; an atom with more than kMaxSlots half edges
// (about 4x the density of liquid water at a 5.2 A cutoff) a NaN row and a NaN
// gradient everywhere.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "aev/cuda/edges.cuh"
#include "common/tensor_id.h"

namespace torchani_fast {
namespace {

constexpr int64_t kMaxSlots = 256;        // half edges per atom
constexpr int64_t kErrOverflow = 2;       // (kErrPairIndex = 1)
constexpr int64_t kMaxSlotPairs = int64_t(1) << 29;  // pair indices in a 32-bit key
constexpr int kSlotAngularShift = 30;

// Which kernels the CUDA AEV uses: TORCHANI_FAST_CUDA_AEV=warp (or unset) or
// old. Read on every call, so one process can time both.
bool use_warp_kernels(int64_t P) {
  const char* v = std::getenv("TORCHANI_FAST_CUDA_AEV");
  const bool old = v != nullptr && std::strcmp(v, "old") == 0;
  TORCH_CHECK(v == nullptr || *v == '\0' || old || std::strcmp(v, "warp") == 0,
              "TORCHANI_FAST_CUDA_AEV must be 'warp' (the default) or 'old', got '", v, "'");
  return !old && P <= kMaxSlotPairs;
}

// ---------------------------------------------------------------------------
// Per-atom slots

template <typename scalar_t>
__global__ void slot_fill_kernel(const int64_t* __restrict__ species, int64_t N, int64_t S,
                                 const int64_t* __restrict__ pairs, int64_t P,
                                 const scalar_t* __restrict__ diff, scalar_t rc_r_sq,
                                 scalar_t rc_a, int64_t C, uint8_t* __restrict__ keep,
                                 int64_t* __restrict__ count, int32_t* __restrict__ slots,
                                 int64_t* __restrict__ err) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P;
       p += int64_t(gridDim.x) * blockDim.x) {
    uint8_t k = 0;
    const int64_t a = pairs[p], b = pairs[P + p];
    // A negative index marks an unused slot of a fixed-capacity pair list.
    if (a >= 0 && b >= 0) {
      if (a >= N || b >= N) {
        cuda::atomic_or_i64(err, kErrPairIndex);
      } else {
        const int64_t sa = species[a], sb = species[b];
        if (sa >= 0 && sb >= 0 && sa < S && sb < S) {
          const scalar_t* d = diff + 3 * p;
          const scalar_t r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
          if (r2 <= rc_r_sq) {
            const bool ang = cuda::dsqrt(r2) <= rc_a;
            k = ang ? 2 : 1;
            // Key: not angular, pair, side; sorted, angular neighbours come first.
            const int32_t key = static_cast<int32_t>(((ang ? 0 : 1) << kSlotAngularShift) | (p << 1));
            const int64_t qa = cuda::atomic_add_i64(count + a, 1);
            const int64_t qb = cuda::atomic_add_i64(count + b, 1);
            if (qa < C) slots[a * C + qa] = key;
            if (qb < C) slots[b * C + qb] = key | 1;
            if (qa >= C || qb >= C) cuda::atomic_or_i64(err, kErrOverflow);
          }
        }
      }
    }
    keep[p] = k;
  }
}

// The slots of one call: zeroed counters (count (N) | err (1)), the keys (N, C)
// and the pair flags (P).
struct SlotEdges {
  int64_t N = 0, P = 0, C = 0;
  at::Tensor ints, count, err, slots, keep;
};

template <typename scalar_t>
SlotEdges build_slots(const Params<scalar_t>& k, const at::Tensor& sp, const at::Tensor& pr,
                      const at::Tensor& diff) {
  SlotEdges h;
  h.N = sp.numel();
  h.P = pr.size(1);
  h.C = std::min(kMaxSlots, std::max<int64_t>(2 * h.P, 1));
  h.ints = at::zeros({h.N + 1}, sp.options().dtype(at::kLong));
  h.count = h.ints.narrow(0, 0, h.N);
  h.err = h.ints.narrow(0, h.N, 1);
  h.slots = at::empty({h.N, h.C}, sp.options().dtype(at::kInt));
  h.keep = at::empty({h.P}, sp.options().dtype(at::kByte));
  if (h.P > 0) {
    slot_fill_kernel<scalar_t><<<cuda::grid_for(h.P, kThreads), kThreads, 0,
                                 at::cuda::getCurrentCUDAStream()>>>(
        sp.data_ptr<int64_t>(), h.N, k.S, pr.data_ptr<int64_t>(), h.P, diff.data_ptr<scalar_t>(),
        k.rc_r_sq, k.rc_a, h.C, h.keep.data_ptr<uint8_t>(), h.count.data_ptr<int64_t>(),
        h.slots.data_ptr<int32_t>(), h.err.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return h;
}

// ---------------------------------------------------------------------------
// Shared memory of one warp: the constants, one AEV (or gradient) row, the
// atom's sorted half edges and a scratch row per lane.

// Scratch scalars per lane: radial terms (R), angular terms and f1 per section
// (AZ + Z), or f1, df1 per section and two half-edge gradients (2Z + 6). Odd, so
// that the lanes' rows start in different banks.
inline int64_t scratch_width(int64_t R, int64_t AZ, int64_t Z) {
  return std::max({R, AZ + Z, 2 * Z + 6}) | 1;
}

template <typename scalar_t>
struct WarpSmem {
  int32_t *raw_keys, *keys, *nsp, *tj, *tk, *tpi;
  SharedConsts<scalar_t> c;
  scalar_t *row;      // F
  scalar_t *ev;       // C x 4: centre-to-neighbour vector and its length (kVx..kR)
  scalar_t *fr, *dfr;  // radial cutoff and its derivative, C each
  scalar_t *fa, *dfa;  // angular cutoff and its derivative (0 beyond it), C each
  scalar_t *gacc;      // C x 3: d(loss)/d(half edge vector) (backward)
  scalar_t *scratch;   // kWarp x W

  // Integers first (C int32 keys twice, C species, 3 x kWarp triple indices),
  // padded to 16 bytes, then the scalars.
  __host__ __device__ static int64_t int_bytes(int64_t C) { return ((3 * C + 3 * kWarp) * 4 + 15) / 16 * 16; }
  static size_t bytes(const Params<scalar_t>& k, int64_t C, int64_t W) {
    return static_cast<size_t>(int_bytes(C)) +
           static_cast<size_t>(2 * k.R + 5 * k.AZ + k.F + 11 * C + kWarp * W) * sizeof(scalar_t);
  }

  __device__ WarpSmem(const Params<scalar_t>& k, int64_t C, int64_t W, unsigned char* smem)
      : raw_keys(reinterpret_cast<int32_t*>(smem)),
        keys(raw_keys + C),
        nsp(keys + C),
        tj(nsp + C),
        tk(tj + kWarp),
        tpi(tk + kWarp),
        c(k, reinterpret_cast<scalar_t*>(smem + int_bytes(C))) {
    row = c.end(k);
    ev = row + k.F;
    fr = ev + 4 * C;
    dfr = fr + C;
    fa = dfr + C;
    dfa = fa + C;
    gacc = dfa + C;
    scratch = gacc + 3 * C;
  }
};

// Triple t of the row-major enumeration of the pairs j < l of na angular
// neighbours; row j starts at j (2 na - j - 1) / 2.
__device__ __forceinline__ void triple_of(int64_t t, int64_t na, int& j, int& l) {
  auto row_start = [na](int64_t r) { return r * (2 * na - r - 1) / 2; };
  const double b = 2.0 * static_cast<double>(na) - 1.0;
  int64_t r = static_cast<int64_t>((b - cuda::dsqrt(b * b - 8.0 * static_cast<double>(t))) / 2.0);
  r = cuda::imax(0, cuda::imin(r, na - 2));
  while (r > 0 && row_start(r) > t) --r;  // (the estimate is off by at most one)
  while (r < na - 2 && row_start(r + 1) <= t) ++r;
  j = static_cast<int>(r);
  l = static_cast<int>(r + 1 + (t - row_start(r)));
}

// Stages the n half edges of atom i (all lanes of the warp call it): sorted
// keys, vectors, cutoffs and neighbour species. Returns the number of angular
// neighbours (they come first).
template <typename scalar_t>
__device__ int64_t stage_edges(const Params<scalar_t>& k, const WarpSmem<scalar_t>& s,
                               int64_t i, int64_t n, int64_t C,
                               const int32_t* __restrict__ slots,
                               const int64_t* __restrict__ species,
                               const int64_t* __restrict__ pairs, int64_t P,
                               const scalar_t* __restrict__ diff, int lane) {
  for (int64_t q = lane; q < n; q += kWarp) s.raw_keys[q] = slots[i * C + q];
  __syncwarp();
  // Rank sort: the keys of an atom are distinct (pair, side).
  int na = 0;
  for (int64_t q = lane; q < n; q += kWarp) {
    const int32_t mine = s.raw_keys[q];
    int64_t rank = 0;
    for (int64_t o = 0; o < n; ++o) rank += s.raw_keys[o] < mine;
    s.keys[rank] = mine;
    na += (mine >> kSlotAngularShift) == 0;
  }
  na = warp_sum(na);
  __syncwarp();
  for (int64_t q = lane; q < n; q += kWarp) {
    const int32_t key = s.keys[q];
    const int64_t p = (key & ((1 << kSlotAngularShift) - 1)) >> 1;
    const int side = key & 1;
    // diff = x[i0] - x[i1]: the vector from the centre to the neighbour is
    // -diff when the centre is i0 and +diff when it is i1.
    const scalar_t sign = side == 0 ? scalar_t(-1) : scalar_t(1);
    scalar_t* e = s.ev + 4 * q;
    e[kVx] = sign * diff[3 * p];
    e[kVy] = sign * diff[3 * p + 1];
    e[kVz] = sign * diff[3 * p + 2];
    const scalar_t r = cuda::dsqrt(e[kVx] * e[kVx] + e[kVy] * e[kVy] + e[kVz] * e[kVz]);
    e[kR] = r;
    s.fr[q] = cutoff_value(k.cut, r, k.rc_r);
    s.dfr[q] = cutoff_deriv(k.cut, r, k.rc_r);
    const bool ang = q < na;
    s.fa[q] = ang ? cutoff_value(k.cut, r, k.rc_a) : scalar_t(0);
    s.dfa[q] = ang ? cutoff_deriv(k.cut, r, k.rc_a) : scalar_t(0);
    s.nsp[q] = static_cast<int32_t>(species[side == 0 ? pairs[P + p] : pairs[p]]);
  }
  __syncwarp();
  return na;
}

// ---------------------------------------------------------------------------
// Forward

template <typename scalar_t>
__global__ void warp_forward_kernel(Params<scalar_t> k, int64_t N, int64_t C, int64_t W,
                                    const int64_t* __restrict__ species,
                                    const int64_t* __restrict__ pairs, int64_t P,
                                    const scalar_t* __restrict__ diff,
                                    const int64_t* __restrict__ count,
                                    const int32_t* __restrict__ slots,
                                    const int64_t* __restrict__ err,
                                    scalar_t* __restrict__ aev) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const WarpSmem<scalar_t> s(k, C, W, smem_raw);
  __syncwarp();
  const int lane = threadIdx.x;
  const bool failed = (err[0] & kErrPairIndex) != 0;
  const int64_t R = k.R, Z = k.Z, AZ = k.AZ;
  scalar_t* mine = s.scratch + lane * W;

  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    for (int64_t f = lane; f < k.F; f += kWarp) s.row[f] = scalar_t(0);
    const int64_t s_i = species[i], n = count[i];
    const bool bad = failed || s_i < -1 || s_i >= k.S || n > C;
    __syncwarp();
    if (!bad && s_i >= 0 && n > 0) {
      const int64_t na = stage_edges(k, s, i, n, C, slots, species, pairs, P, diff, lane);
      // Radial: lane t takes neighbour base + t, lane f then sums column f.
      for (int64_t base = 0; base < n; base += kWarp) {
        const int64_t m = cuda::imin(kWarp, n - base);
        if (lane < m) {
          const int64_t q = base + lane;
          const scalar_t r = s.ev[4 * q + kR], fc = s.fr[q];
          for (int64_t c = 0; c < R; ++c) {
            const scalar_t x = r - s.c.shf_r[c];
            // TorchANI's radial terms carry a factor 0.25.
            mine[c] = scalar_t(0.25) * cuda::dexp(-s.c.eta_r[c] * x * x) * fc;
          }
        }
        __syncwarp();
        for (int64_t c = lane; c < R; c += kWarp)
          for (int64_t t = 0; t < m; ++t) s.row[s.nsp[base + t] * R + c] += s.scratch[t * W + c];
        __syncwarp();
      }
      // Angular: lane t takes triple base + t.
      const int64_t T = na * (na - 1) / 2;
      for (int64_t base = 0; base < T; base += kWarp) {
        const int64_t m = cuda::imin(kWarp, T - base);
        if (lane < m) {
          int j, l;
          triple_of(base + lane, na, j, l);
          const scalar_t* e1 = s.ev + 4 * j;
          const scalar_t* e2 = s.ev + 4 * l;
          const Triple<scalar_t> tr(e1, e2);
          const scalar_t fcc = s.fa[j] * s.fa[l];
          s.tpi[lane] = static_cast<int32_t>(pair_index(s.nsp[j], s.nsp[l], k.S));
          // 2 ((1 + cos(acos(0.95 cos t) - ts)) / 2)^zeta per section, with
          // cos(acos(c) - ts) = c cos(ts) + sqrt(1 - c^2) sin(ts).
          scalar_t* f1 = mine + AZ;
          for (int64_t z = 0; z < Z; ++z) {
            const scalar_t cdev = tr.c * s.c.cos_z[z] + tr.sin_c * s.c.sin_z[z];
            f1[z] = scalar_t(2) * cuda::dpow((scalar_t(1) + cdev) / scalar_t(2), s.c.zeta[z]);
          }
          for (int64_t a = 0; a < k.A; ++a) {
            const scalar_t x = tr.mean_r - s.c.shf_a[a * Z];
            const scalar_t f2 = cuda::dexp(-s.c.eta_a[a * Z] * x * x) * fcc;
            for (int64_t z = 0; z < Z; ++z) mine[a * Z + z] = f2 * f1[z];
          }
        }
        __syncwarp();
        for (int64_t f = lane; f < AZ; f += kWarp)
          for (int64_t t = 0; t < m; ++t)
            s.row[k.radial_len + s.tpi[t] * AZ + f] += s.scratch[t * W + f];
        __syncwarp();
      }
    }
    for (int64_t f = lane; f < k.F; f += kWarp) aev[i * k.F + f] = bad ? scalar_t(NAN) : s.row[f];
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------
// Backward

template <typename scalar_t>
__global__ void warp_backward_kernel(Params<scalar_t> k, int64_t N, int64_t C, int64_t W,
                                     const int64_t* __restrict__ species,
                                     const int64_t* __restrict__ pairs, int64_t P,
                                     const scalar_t* __restrict__ diff,
                                     const int64_t* __restrict__ count,
                                     const int32_t* __restrict__ slots,
                                     const int64_t* __restrict__ err,
                                     const scalar_t* __restrict__ grad_aev,
                                     scalar_t* __restrict__ grad_half) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const WarpSmem<scalar_t> s(k, C, W, smem_raw);
  __syncwarp();
  const int lane = threadIdx.x;
  if (err[0] != 0) return;  // pair_gather_kernel writes zeros or NaN
  const int64_t R = k.R, Z = k.Z, AZ = k.AZ;
  scalar_t* mine = s.scratch + lane * W;

  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int64_t s_i = species[i], n = count[i];
    // Atoms without half edges (padding, invalid species, no neighbours) own no gradient.
    if (s_i < 0 || s_i >= k.S || n == 0) continue;
    for (int64_t f = lane; f < k.F; f += kWarp) s.row[f] = grad_aev[i * k.F + f];
    const int64_t na = stage_edges(k, s, i, n, C, slots, species, pairs, P, diff, lane);
    // Radial: each half edge's first term, by the lane that owns it.
    for (int64_t q = lane; q < n; q += kWarp) {
      const scalar_t* e = s.ev + 4 * q;
      const scalar_t r = e[kR], fc = s.fr[q], dfc = s.dfr[q];
      const scalar_t* gs = s.row + static_cast<int64_t>(s.nsp[q]) * R;
      scalar_t dr = 0;
      for (int64_t c = 0; c < R; ++c) {
        const scalar_t x = r - s.c.shf_r[c];
        const scalar_t ex = scalar_t(0.25) * cuda::dexp(-s.c.eta_r[c] * x * x);
        dr += gs[c] * ex * (dfc - scalar_t(2) * s.c.eta_r[c] * x * fc);
      }
      // Coincident atoms: the direction is undefined, no gradient.
      for (int d = 0; d < 3; ++d) s.gacc[3 * q + d] = r > scalar_t(0) ? dr * e[kVx + d] / r : scalar_t(0);
    }
    __syncwarp();
    const int64_t T = na * (na - 1) / 2;
    for (int64_t base = 0; base < T; base += kWarp) {
      const int64_t m = cuda::imin(kWarp, T - base);
      if (lane < m) {
        int j, l;
        triple_of(base + lane, na, j, l);
        const scalar_t* e1 = s.ev + 4 * j;
        const scalar_t* e2 = s.ev + 4 * l;
        const Triple<scalar_t> tr(e1, e2);
        const scalar_t* gs = s.row + k.radial_len + pair_index(s.nsp[j], s.nsp[l], k.S) * AZ;
        scalar_t* f1 = mine;
        scalar_t* df1 = mine + Z;
        for (int64_t z = 0; z < Z; ++z) {
          const scalar_t cdev = tr.c * s.c.cos_z[z] + tr.sin_c * s.c.sin_z[z];
          const scalar_t base_z = (scalar_t(1) + cdev) / scalar_t(2);
          f1[z] = scalar_t(2) * cuda::dpow(base_z, s.c.zeta[z]);
          // d cos(acos(c) - ts)/dc = cos(ts) - c / sqrt(1 - c^2) * sin(ts)
          const scalar_t dcdev = s.c.cos_z[z] - tr.c / tr.sin_c * s.c.sin_z[z];
          df1[z] = s.c.zeta[z] * cuda::dpow(base_z, s.c.zeta[z] - scalar_t(1)) * dcdev;
        }
        scalar_t s_val = 0, s_dc = 0, s_dm = 0;
        for (int64_t a = 0; a < k.A; ++a) {
          const scalar_t x = tr.mean_r - s.c.shf_a[a * Z];
          const scalar_t f2 = cuda::dexp(-s.c.eta_a[a * Z] * x * x);
          const scalar_t df2 = scalar_t(-2) * s.c.eta_a[a * Z] * x * f2;
          for (int64_t z = 0; z < Z; ++z) {
            const scalar_t gf = gs[a * Z + z];
            s_val += gf * f1[z] * f2;
            s_dm += gf * f1[z] * df2;
            s_dc += gf * df1[z] * f2;
          }
        }
        const scalar_t fc1 = s.fa[j], fc2 = s.fa[l];
        const scalar_t fcc = fc1 * fc2;
        // d/d(cos_raw) through c = 0.95 cos_raw; d/dr_i through the mean
        // distance (factor 1/2) and through the cutoff of that neighbour.
        const scalar_t d_cos = scalar_t(0.95) * fcc * s_dc;
        const scalar_t d_r1 = scalar_t(0.5) * fcc * s_dm + s_val * s.dfa[j] * fc2;
        const scalar_t d_r2 = scalar_t(0.5) * fcc * s_dm + s_val * fc1 * s.dfa[l];
        const scalar_t r1 = e1[kR], r2 = e2[kR];
        scalar_t* g1 = mine + 2 * Z;
        scalar_t* g2 = g1 + 3;
        if (tr.clamped) {
          const scalar_t inv = scalar_t(1e10);
          for (int d = 0; d < 3; ++d) {
            g1[d] = d_cos * e2[kVx + d] * inv;
            g2[d] = d_cos * e1[kVx + d] * inv;
          }
        } else {
          const scalar_t inv = scalar_t(1) / (r1 * r2);
          for (int d = 0; d < 3; ++d) {
            g1[d] = d_cos * (e2[kVx + d] * inv - tr.cos_raw * e1[kVx + d] / (r1 * r1));
            g2[d] = d_cos * (e1[kVx + d] * inv - tr.cos_raw * e2[kVx + d] / (r2 * r2));
          }
        }
        if (r1 > scalar_t(0))
          for (int d = 0; d < 3; ++d) g1[d] += d_r1 * e1[kVx + d] / r1;
        if (r2 > scalar_t(0))
          for (int d = 0; d < 3; ++d) g2[d] += d_r2 * e2[kVx + d] / r2;
        s.tj[lane] = j;
        s.tk[lane] = l;
      }
      __syncwarp();
      // The lane that owns half edge q adds its terms in triple order.
      for (int64_t q = lane; q < na; q += kWarp)
        for (int64_t t = 0; t < m; ++t) {
          const scalar_t* g = s.scratch + t * W + 2 * Z;
          if (s.tj[t] == q)
            for (int d = 0; d < 3; ++d) s.gacc[3 * q + d] += g[d];
          if (s.tk[t] == q)
            for (int d = 0; d < 3; ++d) s.gacc[3 * q + d] += g[3 + d];
        }
      __syncwarp();
    }
    // Half edge (pair p, side) -> row 2p + side.
    for (int64_t q = lane; q < n; q += kWarp) {
      const int32_t key = s.keys[q];
      const int64_t h = key & ((1 << kSlotAngularShift) - 1);
      for (int d = 0; d < 3; ++d) grad_half[3 * h + d] = s.gacc[3 * q + d];
    }
    __syncwarp();
  }
}

// Back from half edges to pairs: the centre-to-neighbour vector is -diff for
// the half edge owned by i0 and +diff for the one owned by i1.
template <typename scalar_t>
__global__ void pair_gather_kernel(int64_t P, const uint8_t* __restrict__ keep,
                                   const int64_t* __restrict__ err,
                                   const scalar_t* __restrict__ grad_half,
                                   scalar_t* __restrict__ grad_diff) {
  const int64_t e = err[0];
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P;
       p += int64_t(gridDim.x) * blockDim.x) {
    for (int d = 0; d < 3; ++d) {
      scalar_t out = 0;
      if ((e & kErrOverflow) != 0)
        out = scalar_t(NAN);
      else if (e == 0 && keep[p] != 0)
        out = grad_half[3 * (2 * p + 1) + d] - grad_half[3 * (2 * p) + d];
      grad_diff[3 * p + d] = out;
    }
  }
}

// ---------------------------------------------------------------------------
// Host side

template <typename scalar_t>
struct WarpLaunch {
  int64_t W;
  size_t smem;
  unsigned int blocks;
};

template <typename scalar_t>
WarpLaunch<scalar_t> warp_launch(const Params<scalar_t>& k, const SlotEdges& h) {
  WarpLaunch<scalar_t> w;
  w.W = scratch_width(k.R, k.AZ, k.Z);
  w.smem = WarpSmem<scalar_t>::bytes(k, h.C, w.W);
  // Any grid gives the same bits (one warp owns an atom); enough blocks to fill the GPU.
  const int64_t cap =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 16;
  w.blocks = static_cast<unsigned int>(std::max<int64_t>(1, std::min(h.N, cap)));
  return w;
}

template <typename scalar_t>
void warp_forward(const char* op, const Params<scalar_t>& k, const at::Tensor& sp,
                  const at::Tensor& pr, const at::Tensor& diff, const SlotEdges& h,
                  at::Tensor& aev) {
  const auto w = warp_launch(k, h);
  reserve_smem(op, warp_forward_kernel<scalar_t>, w.smem, k.F);
  warp_forward_kernel<scalar_t><<<w.blocks, kWarp, w.smem, at::cuda::getCurrentCUDAStream()>>>(
      k, h.N, h.C, w.W, sp.data_ptr<int64_t>(), pr.data_ptr<int64_t>(), h.P,
      diff.data_ptr<scalar_t>(), h.count.data_ptr<int64_t>(), h.slots.data_ptr<int32_t>(),
      h.err.data_ptr<int64_t>(), aev.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void warp_backward(const char* op, const Params<scalar_t>& k, const at::Tensor& sp,
                   const at::Tensor& pr, const at::Tensor& diff, const SlotEdges& h,
                   const at::Tensor& grad_aev, at::Tensor& grad_diff) {
  const auto w = warp_launch(k, h);
  // Rows of pairs that are not kept are never read (pair_gather_kernel).
  auto grad_half = at::empty({2 * h.P, 3}, diff.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  reserve_smem(op, warp_backward_kernel<scalar_t>, w.smem, k.F);
  warp_backward_kernel<scalar_t><<<w.blocks, kWarp, w.smem, stream>>>(
      k, h.N, h.C, w.W, sp.data_ptr<int64_t>(), pr.data_ptr<int64_t>(), h.P,
      diff.data_ptr<scalar_t>(), h.count.data_ptr<int64_t>(), h.slots.data_ptr<int32_t>(),
      h.err.data_ptr<int64_t>(), grad_aev.data_ptr<scalar_t>(), grad_half.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  pair_gather_kernel<scalar_t><<<cuda::grid_for(h.P, kThreads), kThreads, 0, stream>>>(
      h.P, h.keep.data_ptr<uint8_t>(), h.err.data_ptr<int64_t>(), grad_half.data_ptr<scalar_t>(),
      grad_diff.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// The forward's slots, kept for the backward of the same call (aev_with_edges /
// aev_backward_edges), as the CPU kernels keep their half edges (aev_cpu.cpp):
// a (0,) uint8 handle whose storage owns them, read back only for the very
// input tensors they were built from (same TensorImpl, version, data pointer,
// sizes and strides; same cutoffs and species count).

struct KeptSlots {
  SlotEdges slots;
  TensorId species, pairs, diff;
  double rc_r, rc_a;
  int64_t num_species;
};

constexpr int64_t kMaxKeptSlotBytes = int64_t(64) << 20;

void delete_kept_slots(void* context) { delete static_cast<KeptSlots*>(context); }

at::Tensor slots_handle(const at::Tensor& species, const at::Tensor& pairs,
                        const at::Tensor& diff, const AEVParams& p, SlotEdges slots) {
  const auto options = diff.options().dtype(at::kByte);
  if (species.is_inference() || pairs.is_inference() || diff.is_inference() ||
      slots.slots.nbytes() + slots.keep.nbytes() > kMaxKeptSlotBytes)
    return at::empty({0}, options);
  auto* kept = new KeptSlots{std::move(slots), TensorId(species), TensorId(pairs), TensorId(diff),
                             p.radial_cutoff, p.angular_cutoff, p.num_species};
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(kept, kept, &delete_kept_slots, diff.device()),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, options).set_(storage);
}

const SlotEdges* kept_slots(const at::Tensor& handle, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff,
                            const AEVParams& p) {
  if (!handle.defined() || !handle.has_storage()) return nullptr;
  const c10::DataPtr& ptr = handle.storage().data_ptr();
  if (ptr.get_deleter() != &delete_kept_slots) return nullptr;
  const auto* kept = static_cast<const KeptSlots*>(ptr.get_context());
  const bool same = kept->species.same(species) && kept->pairs.same(pairs) &&
                    kept->diff.same(diff) && kept->rc_r == p.radial_cutoff &&
                    kept->rc_a == p.angular_cutoff && kept->num_species == p.num_species;
  return same ? &kept->slots : nullptr;
}

}  // namespace
}  // namespace torchani_fast
