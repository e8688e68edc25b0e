// Helpers shared by the CPU AEV kernels (aev/aev_cpu.cpp: forward and backward;
// aev/second_cpu.cpp: second derivatives): the half-edge layout, the
// constants in the working dtype, the cutoff and the angular triple geometry.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "aev/second_derivs.h"
#include "common/parallel.h"
#include "ops.h"

namespace torchani_fast {
namespace aev_cpu_detail {

// The neighbour, triple and cutoff helpers are shared with the CUDA kernels.
using aev_math::cutoff_cos;
using aev_math::cutoff_cos_deriv;
using aev_math::make_triple;
using aev_math::Neighbor;

// A std::vector allocator that leaves new elements uninitialised, for large
// index and gradient arrays that are written in parallel before they are read
// (value-initialising them would be one thread's memset).
template <typename T>
struct UninitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <typename U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using UninitVector = std::vector<T, UninitAllocator<T>>;

// Half edges grouped by their owning atom (compressed sparse rows), and inside
// each atom by the neighbour's species.
struct HalfEdges {
  bool vectors = false;          // vec (and no pair, other) written
  std::vector<int64_t> start;    // (N+1,) first half edge of each atom
  std::vector<int64_t> seg;      // (N*S+1,) first half edge of each (atom, neighbour species)
  UninitVector<int64_t> pair;    // (E,) pair index (without vectors)
  UninitVector<int64_t> other;   // (E,) the neighbour atom (without vectors)
  UninitVector<float> vec;       // (E, 4) with vectors (float32): centre-to-neighbour x, y, z (and 0)
  UninitVector<double> vec64;    // (E, 4) the same with vectors in float64
  UninitVector<int64_t> edge0;   // (P,) half edge owned by i0, or -1
  UninitVector<int64_t> edge1;   // (P,) half edge owned by i1, or -1
  int64_t edges() const { return start.back(); }
  size_t bytes() const {
    return sizeof(int64_t) * (start.size() + seg.size() + pair.size() + other.size() +
                              edge0.size() + edge1.size()) +
           sizeof(float) * vec.size() + sizeof(double) * vec64.size();
  }
};

// Pairs that touch a padding atom or lie beyond the radial cutoff are dropped
// here, so callers may pass any superset of the true neighbour list.
//
// In parallel over contiguous chunks of pairs: each chunk counts its half
// edges per (atom, neighbour species), then places them after those of the
// chunks before it. Every atom's half edges therefore come by species, each
// species in pair order, exactly as one serial pass over the pairs would
// place them, for any number of chunks (the AEV sums over them in that
// order: the same bits for any thread count).
//
// vectors: store each half edge's centre-to-neighbour vector, in the working
// dtype (vec or vec64: for the vectorised AEV kernels, which then read them in
// order) instead of its pair and neighbour atom (for the portable kernels,
// HalfEdgeView).
template <typename scalar_t>
HalfEdges build_half_edges(const int64_t* species, int64_t num_atoms, const int64_t* i0,
                           const int64_t* i1, const scalar_t* diff, int64_t num_pairs,
                           double cutoff, int64_t num_species, bool vectors) {
  static_assert(std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>);
  HalfEdges h;
  h.vectors = vectors;
  const int64_t S = num_species, NS = num_atoms * S;
  const scalar_t cutoff_sq = static_cast<scalar_t>(cutoff * cutoff);
  // (more chunks than one only while their counts take at most 2^24 entries, 128 MB)
  const int64_t chunks = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(at::get_num_threads()), num_pairs / 16384,
                   (int64_t{1} << 24) / std::max<int64_t>(1, NS)}));
  std::vector<int64_t> bounds(chunks + 1);
  for (int64_t c = 0; c <= chunks; ++c) bounds[c] = num_pairs * c / chunks;
  // count: per chunk, atom and neighbour species, the chunk's half edges, and
  // after the prefix pass the first of them.
  std::vector<int64_t> count(chunks * NS, 0), bad(chunks, -1);
  h.edge0.resize(num_pairs);  // -1 for a dropped pair, 0 for a kept one until it is placed
  h.edge1.resize(num_pairs);
  int64_t* const edge0 = h.edge0.data();
  int64_t* const edge1 = h.edge1.data();
  torchani_fast::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* const cnt = count.data() + c * NS;
      for (int64_t p = bounds[c], end = bounds[c + 1]; p < end; ++p) {
        const int64_t a = i0[p], b = i1[p];
        edge0[p] = edge1[p] = -1;
        // A negative index marks an unused slot of a fixed-capacity pair list.
        if (a < 0 || b < 0) continue;
        if (a >= num_atoms || b >= num_atoms) {
          bad[c] = p;  // reported below: the first bad pair of all
          break;
        }
        const int64_t sa = species[a], sb = species[b];
        if (sa < 0 || sb < 0) continue;
        const scalar_t* d = diff + 3 * p;
        const scalar_t r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
        if (!(r2 <= cutoff_sq)) continue;
        edge0[p] = 0;
        cnt[a * S + sb]++;
        cnt[b * S + sa]++;
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t p = bad[c];
    TORCH_CHECK(p < 0, "torchani_fast::aev: pairs must index the ", num_atoms,
                " flattened atoms, got pair ", p, " = (", i0[p < 0 ? 0 : p], ", ",
                i1[p < 0 ? 0 : p], ")");
  }
  h.seg.resize(NS + 1);
  int64_t e = 0;
  for (int64_t n = 0; n < NS; ++n) {
    h.seg[n] = e;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = count[c * NS + n];
      count[c * NS + n] = e;
      e += k;
    }
  }
  h.seg[NS] = e;
  h.start.resize(num_atoms + 1);
  for (int64_t n = 0; n <= num_atoms; ++n) h.start[n] = h.seg[n * S];
  const int64_t num_edges = e;
  if (vectors) {
    (std::is_same_v<scalar_t, float> ? h.vec.resize(4 * num_edges) : h.vec64.resize(4 * num_edges));
  } else {
    h.pair.resize(num_edges);
    h.other.resize(num_edges);
  }
  // (the working dtype's vectors: vec or vec64)
  scalar_t* const vec = [&] {
    if constexpr (std::is_same_v<scalar_t, float>)
      return h.vec.data();
    else
      return h.vec64.data();
  }();
  int64_t* const pair = h.pair.data();
  int64_t* const other = h.other.data();
  torchani_fast::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* const cursor = count.data() + c * NS;
      for (int64_t p = bounds[c], end = bounds[c + 1]; p < end; ++p) {
        if (edge0[p] < 0) continue;
        const int64_t a = i0[p], b = i1[p];
        const int64_t ea = cursor[a * S + species[b]]++, eb = cursor[b * S + species[a]]++;
        edge0[p] = ea;
        edge1[p] = eb;
        if (vectors) {
          // The centre-to-neighbour vector: -diff for i0's half edge, +diff for i1's.
          const scalar_t x = diff[3 * p], y = diff[3 * p + 1], z = diff[3 * p + 2];
          scalar_t* va = vec + 4 * ea;
          scalar_t* vb = vec + 4 * eb;
          va[0] = -x, va[1] = -y, va[2] = -z, va[3] = scalar_t(0);
          vb[0] = x, vb[1] = y, vb[2] = z, vb[3] = scalar_t(0);
        } else {
          pair[ea] = pair[eb] = p;
          other[ea] = b;
          other[eb] = a;
        }
      }
    }
  });
  return h;
}

// Constants converted once per call to the working dtype.
template <typename scalar_t>
struct Consts {
  int64_t S, R, A, Z, F, radial_len;
  scalar_t rc_r, rc_a;
  aev_math::CutoffFn<scalar_t> cut;
  std::vector<scalar_t> eta_r, shf_r, eta_a, zeta, shf_a, cos_z, sin_z;

  explicit Consts(const AEVParams& p) {
    auto vec = [](const at::Tensor& t) {  // (no ATen ops: these run on every call)
      const at::Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
      std::vector<scalar_t> out(c.numel());
      if (c.scalar_type() == at::kFloat) {
        const float* src = c.data_ptr<float>();
        for (int64_t i = 0; i < c.numel(); ++i) out[i] = static_cast<scalar_t>(src[i]);
      } else {
        const at::Tensor d = c.to(at::kDouble);
        const double* src = d.data_ptr<double>();
        for (int64_t i = 0; i < c.numel(); ++i) out[i] = static_cast<scalar_t>(src[i]);
      }
      return out;
    };
    S = p.num_species;
    shf_r = vec(p.radial_shifts);
    R = static_cast<int64_t>(shf_r.size());
    eta_r = vec(p.radial_eta);
    if (eta_r.size() == 1) eta_r.assign(R, eta_r[0]);
    shf_a = vec(p.angular_shifts);
    A = static_cast<int64_t>(shf_a.size());
    eta_a = vec(p.angular_eta);
    if (eta_a.size() == 1) eta_a.assign(A, eta_a[0]);
    auto sections = vec(p.angular_sections);
    Z = static_cast<int64_t>(sections.size());
    zeta = vec(p.angular_zeta);
    if (zeta.size() == 1) zeta.assign(Z, zeta[0]);
    for (auto s : sections) {
      cos_z.push_back(std::cos(s));
      sin_z.push_back(std::sin(s));
    }
    rc_r = static_cast<scalar_t>(p.radial_cutoff);
    rc_a = static_cast<scalar_t>(p.angular_cutoff);
    cut.kind = p.cutoff_kind;
    cut.order = p.cutoff_order;
    cut.eps = static_cast<scalar_t>(p.cutoff_eps);
    radial_len = S * R;
    F = radial_len + S * (S + 1) / 2 * A * Z;
  }
  // Raw-pointer view for the shared functions (valid while *this lives).
  aev_math::ConstView<scalar_t> view() const {
    return {S,           R,           A,           Z,            F,
            radial_len,  rc_r,        rc_a,        eta_r.data(), shf_r.data(),
            eta_a.data(), shf_a.data(), zeta.data(), cos_z.data(),  sin_z.data(),
            cut};
  }
  // Row-major upper-triangular index of the species pair (s1, s2), as torchani's triu_index.
  int64_t pair_index(int64_t s1, int64_t s2) const {
    if (s1 > s2) std::swap(s1, s2);
    return s1 * S - s1 * (s1 - 1) / 2 + (s2 - s1);
  }
};

// The half edges of one centre for the shared per-centre functions
// (aev/second_derivs.h): the same neighbours as gather_neighbors, one at a time.
template <typename scalar_t>
struct HalfEdgeView {
  const int64_t *start_, *pair_, *other_, *edge0_, *species_;
  const scalar_t* diff_;

  HalfEdgeView(const HalfEdges& h, const int64_t* species, const scalar_t* diff)
      : start_(h.start.data()), pair_(h.pair.data()), other_(h.other.data()),
        edge0_(h.edge0.data()), species_(species), diff_(diff) {}
  int64_t begin(int64_t i) const { return start_[i]; }
  int64_t end(int64_t i) const { return start_[i + 1]; }
  int64_t other(int64_t e) const { return other_[e]; }
  int64_t pair(int64_t e) const { return pair_[e]; }
  Neighbor<scalar_t> neighbor(int64_t e) const {
    const int64_t p = pair_[e];
    const scalar_t sign = (edge0_[p] == e) ? scalar_t(-1) : scalar_t(1);
    Neighbor<scalar_t> n;
    for (int c = 0; c < 3; ++c) n.v[c] = sign * diff_[3 * p + c];
    n.r = std::sqrt(n.v[0] * n.v[0] + n.v[1] * n.v[1] + n.v[2] * n.v[2]);
    n.species = species_[other_[e]];
    n.edge = e;
    return n;
  }
};

template <typename scalar_t>
void gather_neighbors(const HalfEdges& h, int64_t center, const int64_t* species,
                      const scalar_t* diff, std::vector<Neighbor<scalar_t>>& out) {
  const HalfEdgeView<scalar_t> hv(h, species, diff);
  out.clear();
  for (int64_t e = hv.begin(center); e < hv.end(center); ++e) out.push_back(hv.neighbor(e));
}

// Per-half-edge values (3 per edge) -> per-pair values (P, 3): the
// centre-to-neighbour vector is -diff for the half edge owned by i0 and +diff
// for the one owned by i1. Pairs without half edges get zeros (out may be
// uninitialised).
template <typename scalar_t>
void edges_to_pairs(const HalfEdges& h, const scalar_t* edge_vals, int64_t num_pairs,
                    scalar_t* out) {
  torchani_fast::parallel_for(0, num_pairs, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t e0 = h.edge0[q], e1 = h.edge1[q];
      for (int c = 0; c < 3; ++c)
        out[3 * q + c] = e0 < 0 ? scalar_t(0) : edge_vals[3 * e1 + c] - edge_vals[3 * e0 + c];
    }
  });
}

inline int64_t aev_length(const AEVParams& p) {
  const int64_t S = p.num_species;
  return S * p.radial_shifts.numel() +
         S * (S + 1) / 2 * p.angular_shifts.numel() * p.angular_sections.numel();
}

inline at::Tensor species_checked(const char* op, const at::Tensor& species, int64_t num_species) {
  auto s = species.to(at::kLong).contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t i = 0; i < s.numel(); ++i)
    TORCH_CHECK(sp[i] >= -1 && sp[i] < num_species, op, ": species must be -1 (padding) or in [0, ",
                num_species, "), got ", sp[i], " at flattened atom ", i);
  return s;
}

// The inputs of every CPU AEV op, checked and in the kernels' layout: species
// int64 with valid values, pairs int64 (2, P), diff vectors contiguous (P, 3).
struct AevInputs {
  at::Tensor species, pairs, diff;
  int64_t N, P;

  AevInputs(const char* op, const at::Tensor& species_in, const at::Tensor& pairs_in,
            const at::Tensor& diff_vectors, const AEVParams& p) {
    check_aev_inputs(op, species_in, pairs_in, diff_vectors, p);
    species = species_checked(op, species_in, p.num_species);
    pairs = pairs_in.to(at::kLong).contiguous();
    diff = diff_vectors.contiguous();
    N = species.numel();
    P = pairs.size(1);
  }
  // Another input (grad_aev, a tangent) in the working dtype, contiguous.
  at::Tensor working(const at::Tensor& t) const { return t.to(diff.scalar_type()).contiguous(); }
  // vectors: see build_half_edges.
  template <typename scalar_t>
  HalfEdges half_edges(const AEVParams& p, bool vectors = false) const {
    const int64_t* pr = pairs.data_ptr<int64_t>();
    return build_half_edges(species.data_ptr<int64_t>(), N, pr, pr + P,
                            diff.data_ptr<scalar_t>(), P, p.radial_cutoff, p.num_species,
                            vectors);
  }
};

// Shape of an AEV (species.shape + (F,)) and the check of an incoming AEV gradient.
inline std::vector<int64_t> aev_shape(const at::Tensor& species, const AEVParams& p) {
  std::vector<int64_t> shape(species.sizes().begin(), species.sizes().end());
  shape.push_back(aev_length(p));
  return shape;
}
inline void check_grad_aev(const char* op, const at::Tensor& grad_aev, const at::Tensor& species,
                           const AEVParams& p) {
  TORCH_CHECK(grad_aev.numel() == species.numel() * aev_length(p), op,
              ": grad_aev must have shape species.shape + (", aev_length(p), ",), got ",
              grad_aev.sizes());
}

}  // namespace aev_cpu_detail
}  // namespace torchani_fast
