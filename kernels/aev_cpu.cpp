// CPU AEV from a half neighbour list: forward and backward, parallel over atoms.
//
// Each pair p = (i0, i1) with diff_vectors[p] = x[i0] - x[i1] (+ lattice shift)
// is expanded into two "half edges", one owned by each atom. An atom only ever
// writes its own AEV row (forward) and the gradients of its own half edges
// (backward), so the parallel loop over atoms needs no atomics and gives the same
// bits for any number of threads.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "ops.h"

namespace torchani_fast {
namespace {

// Half edges grouped by their owning atom (compressed sparse rows).
struct HalfEdges {
  std::vector<int64_t> start;   // (N+1,) first half edge of each atom
  std::vector<int64_t> pair;    // (E,) pair index
  std::vector<int64_t> other;   // (E,) the neighbour atom
  std::vector<int64_t> edge0;   // (P,) half edge owned by i0, or -1
  std::vector<int64_t> edge1;   // (P,) half edge owned by i1, or -1
};

// Pairs that touch a padding atom or lie beyond the radial cutoff are dropped
// here, so callers may pass any superset of the true neighbour list.
template <typename scalar_t>
HalfEdges build_half_edges(const int64_t* species, int64_t num_atoms, const int64_t* i0,
                           const int64_t* i1, const scalar_t* diff, int64_t num_pairs,
                           double cutoff) {
  HalfEdges h;
  h.start.assign(num_atoms + 1, 0);
  h.edge0.assign(num_pairs, -1);
  h.edge1.assign(num_pairs, -1);
  const scalar_t cutoff_sq = static_cast<scalar_t>(cutoff * cutoff);
  std::vector<char> keep(num_pairs, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t a = i0[p], b = i1[p];
    // A negative index marks an unused slot of a fixed-capacity pair list.
    if (a < 0 || b < 0) continue;
    TORCH_CHECK(a < num_atoms && b < num_atoms, "torchani_fast::aev: pairs must index the ",
                num_atoms, " flattened atoms, got pair ", p, " = (", a, ", ", b, ")");
    if (species[a] < 0 || species[b] < 0) continue;
    const scalar_t* d = diff + 3 * p;
    const scalar_t r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
    if (!(r2 <= cutoff_sq)) continue;
    keep[p] = 1;
    h.start[a + 1]++;
    h.start[b + 1]++;
  }
  for (int64_t n = 0; n < num_atoms; ++n) h.start[n + 1] += h.start[n];
  const int64_t num_edges = h.start[num_atoms];
  h.pair.resize(num_edges);
  h.other.resize(num_edges);
  std::vector<int64_t> cursor(h.start.begin(), h.start.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) {
    if (!keep[p]) continue;
    const int64_t a = i0[p], b = i1[p];
    int64_t e = cursor[a]++;
    h.pair[e] = p;
    h.other[e] = b;
    h.edge0[p] = e;
    e = cursor[b]++;
    h.pair[e] = p;
    h.other[e] = a;
    h.edge1[p] = e;
  }
  return h;
}

// Constants converted once per call to the working dtype.
template <typename scalar_t>
struct Consts {
  int64_t S, R, A, Z, F, radial_len;
  scalar_t rc_r, rc_a;
  std::vector<scalar_t> eta_r, shf_r, eta_a, zeta, shf_a, cos_z, sin_z;

  explicit Consts(const AEVParams& p) {
    auto vec = [](const at::Tensor& t) {
      auto c = t.to(at::kDouble).contiguous();
      std::vector<scalar_t> out(c.numel());
      for (int64_t i = 0; i < c.numel(); ++i)
        out[i] = static_cast<scalar_t>(c.data_ptr<double>()[i]);
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
    radial_len = S * R;
    F = radial_len + S * (S + 1) / 2 * A * Z;
  }
  // Row-major upper-triangular index of the species pair (s1, s2), as torchani's triu_index.
  int64_t pair_index(int64_t s1, int64_t s2) const {
    if (s1 > s2) std::swap(s1, s2);
    return s1 * S - s1 * (s1 - 1) / 2 + (s2 - s1);
  }
};

template <typename scalar_t>
inline scalar_t cutoff_cos(scalar_t r, scalar_t rc) {
  return scalar_t(0.5) * std::cos(r * (scalar_t(M_PI) / rc)) + scalar_t(0.5);
}
template <typename scalar_t>
inline scalar_t cutoff_cos_deriv(scalar_t r, scalar_t rc) {
  return scalar_t(-0.5) * (scalar_t(M_PI) / rc) * std::sin(r * (scalar_t(M_PI) / rc));
}

// One neighbour of the centre atom: vector from the centre to it, its length,
// its species and the half edge it came from.
template <typename scalar_t>
struct Neighbor {
  scalar_t v[3];
  scalar_t r;
  int64_t species;
  int64_t edge;
};

template <typename scalar_t>
void gather_neighbors(const HalfEdges& h, int64_t center, const int64_t* species,
                      const scalar_t* diff, std::vector<Neighbor<scalar_t>>& out) {
  out.clear();
  for (int64_t e = h.start[center]; e < h.start[center + 1]; ++e) {
    const int64_t p = h.pair[e];
    // diff = x[i0] - x[i1]: the vector from the centre to the neighbour is
    // -diff when the centre is i0 and +diff when it is i1.
    const scalar_t sign = (h.edge0[p] == e) ? scalar_t(-1) : scalar_t(1);
    Neighbor<scalar_t> n;
    for (int c = 0; c < 3; ++c) n.v[c] = sign * diff[3 * p + c];
    n.r = std::sqrt(n.v[0] * n.v[0] + n.v[1] * n.v[1] + n.v[2] * n.v[2]);
    n.species = species[h.other[e]];
    n.edge = e;
    out.push_back(n);
  }
}

// The parts of one angular triple shared by forward and backward.
template <typename scalar_t>
struct Triple {
  scalar_t cos_raw;   // v1.v2 / max(r1 r2, 1e-10)
  scalar_t c;         // 0.95 * cos_raw, so |c| <= 0.95
  scalar_t sin_c;     // sqrt(1 - c^2) = sin(acos(c))
  scalar_t mean_r;    // (r1 + r2) / 2
  bool clamped;       // r1 r2 < 1e-10
};

template <typename scalar_t>
Triple<scalar_t> make_triple(const Neighbor<scalar_t>& n1, const Neighbor<scalar_t>& n2) {
  Triple<scalar_t> t;
  const scalar_t dot = n1.v[0] * n2.v[0] + n1.v[1] * n2.v[1] + n1.v[2] * n2.v[2];
  const scalar_t den = n1.r * n2.r;
  t.clamped = den < scalar_t(1e-10);
  t.cos_raw = dot / (t.clamped ? scalar_t(1e-10) : den);
  t.c = scalar_t(0.95) * t.cos_raw;
  t.sin_c = std::sqrt(std::max(scalar_t(1) - t.c * t.c, scalar_t(0)));
  t.mean_r = (n1.r + n2.r) / scalar_t(2);
  return t;
}

template <typename scalar_t>
void forward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                    const Consts<scalar_t>& k, int64_t num_atoms, scalar_t* aev) {
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), f2(k.A);
    for (int64_t i = begin; i < end; ++i) {
      if (species[i] < 0) continue;
      scalar_t* row = aev + i * k.F;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        const scalar_t fc = cutoff_cos(n.r, k.rc_r);
        scalar_t* out = row + n.species * k.R;
        for (int64_t s = 0; s < k.R; ++s) {
          const scalar_t x = n.r - k.shf_r[s];
          out[s] += scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x) * fc;
        }
        if (n.r <= k.rc_a) ang.push_back(n);
      }
      std::vector<scalar_t> fc_a(ang.size());
      for (size_t j = 0; j < ang.size(); ++j) fc_a[j] = cutoff_cos(ang[j].r, k.rc_a);
      for (size_t j = 0; j < ang.size(); ++j) {
        for (size_t l = j + 1; l < ang.size(); ++l) {
          const auto t = make_triple(ang[j], ang[l]);
          const scalar_t fcc = fc_a[j] * fc_a[l];
          for (int64_t z = 0; z < k.Z; ++z) {
            const scalar_t cdev = t.c * k.cos_z[z] + t.sin_c * k.sin_z[z];
            f1[z] = scalar_t(2) * std::pow((scalar_t(1) + cdev) / scalar_t(2), k.zeta[z]);
          }
          for (int64_t a = 0; a < k.A; ++a) {
            const scalar_t x = t.mean_r - k.shf_a[a];
            f2[a] = std::exp(-k.eta_a[a] * x * x) * fcc;
          }
          scalar_t* out = row + k.radial_len +
                          k.pair_index(ang[j].species, ang[l].species) * k.A * k.Z;
          for (int64_t a = 0; a < k.A; ++a)
            for (int64_t z = 0; z < k.Z; ++z) out[a * k.Z + z] += f2[a] * f1[z];
        }
      }
    }
  });
}

template <typename scalar_t>
void backward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                     const Consts<scalar_t>& k, int64_t num_atoms, const scalar_t* grad_aev,
                     scalar_t* grad_edge) {
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), df1(k.Z), f2(k.A), df2(k.A);
    for (int64_t i = begin; i < end; ++i) {
      if (species[i] < 0) continue;
      const scalar_t* grow = grad_aev + i * k.F;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        scalar_t* ge = grad_edge + 3 * n.edge;
        if (n.r <= k.rc_a) ang.push_back(n);
        if (!(n.r > 0)) continue;  // coincident atoms: the direction is undefined
        const scalar_t fc = cutoff_cos(n.r, k.rc_r);
        const scalar_t dfc = cutoff_cos_deriv(n.r, k.rc_r);
        const scalar_t* g = grow + n.species * k.R;
        scalar_t dr = 0;
        for (int64_t s = 0; s < k.R; ++s) {
          const scalar_t x = n.r - k.shf_r[s];
          const scalar_t e = scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x);
          dr += g[s] * e * (dfc - scalar_t(2) * k.eta_r[s] * x * fc);
        }
        for (int c = 0; c < 3; ++c) ge[c] += dr * n.v[c] / n.r;
      }
      const size_t na = ang.size();
      std::vector<scalar_t> fc_a(na), dfc_a(na);
      for (size_t j = 0; j < na; ++j) {
        fc_a[j] = cutoff_cos(ang[j].r, k.rc_a);
        dfc_a[j] = cutoff_cos_deriv(ang[j].r, k.rc_a);
      }
      for (size_t j = 0; j < na; ++j) {
        for (size_t l = j + 1; l < na; ++l) {
          const auto& n1 = ang[j];
          const auto& n2 = ang[l];
          const auto t = make_triple(n1, n2);
          for (int64_t z = 0; z < k.Z; ++z) {
            const scalar_t cdev = t.c * k.cos_z[z] + t.sin_c * k.sin_z[z];
            const scalar_t base = (scalar_t(1) + cdev) / scalar_t(2);
            f1[z] = scalar_t(2) * std::pow(base, k.zeta[z]);
            // d cos(acos(c) - ts)/dc = cos(ts) - c / sqrt(1 - c^2) * sin(ts)
            const scalar_t dcdev = k.cos_z[z] - t.c / t.sin_c * k.sin_z[z];
            df1[z] = k.zeta[z] * std::pow(base, k.zeta[z] - scalar_t(1)) * dcdev;
          }
          for (int64_t a = 0; a < k.A; ++a) {
            const scalar_t x = t.mean_r - k.shf_a[a];
            f2[a] = std::exp(-k.eta_a[a] * x * x);
            df2[a] = scalar_t(-2) * k.eta_a[a] * x * f2[a];
          }
          const scalar_t* g = grow + k.radial_len +
                              k.pair_index(n1.species, n2.species) * k.A * k.Z;
          scalar_t s_val = 0, s_dc = 0, s_dm = 0;
          for (int64_t a = 0; a < k.A; ++a) {
            scalar_t row_f = 0, row_df = 0;
            for (int64_t z = 0; z < k.Z; ++z) {
              row_f += g[a * k.Z + z] * f1[z];
              row_df += g[a * k.Z + z] * df1[z];
            }
            s_val += row_f * f2[a];
            s_dm += row_f * df2[a];
            s_dc += row_df * f2[a];
          }
          const scalar_t fcc = fc_a[j] * fc_a[l];
          // d/d(cos_raw) through c = 0.95 cos_raw; d/dr_i through the mean distance
          // (factor 1/2) and through the cutoff of that neighbour.
          const scalar_t d_cos = scalar_t(0.95) * fcc * s_dc;
          const scalar_t d_r1 = scalar_t(0.5) * fcc * s_dm + s_val * dfc_a[j] * fc_a[l];
          const scalar_t d_r2 = scalar_t(0.5) * fcc * s_dm + s_val * fc_a[j] * dfc_a[l];
          scalar_t* g1 = grad_edge + 3 * n1.edge;
          scalar_t* g2 = grad_edge + 3 * n2.edge;
          if (t.clamped) {
            const scalar_t inv = scalar_t(1e10);
            for (int c = 0; c < 3; ++c) {
              g1[c] += d_cos * n2.v[c] * inv;
              g2[c] += d_cos * n1.v[c] * inv;
            }
          } else {
            const scalar_t inv = scalar_t(1) / (n1.r * n2.r);
            for (int c = 0; c < 3; ++c) {
              g1[c] += d_cos * (n2.v[c] * inv - t.cos_raw * n1.v[c] / (n1.r * n1.r));
              g2[c] += d_cos * (n1.v[c] * inv - t.cos_raw * n2.v[c] / (n2.r * n2.r));
            }
          }
          if (n1.r > 0)
            for (int c = 0; c < 3; ++c) g1[c] += d_r1 * n1.v[c] / n1.r;
          if (n2.r > 0)
            for (int c = 0; c < 3; ++c) g2[c] += d_r2 * n2.v[c] / n2.r;
        }
      }
    }
  });
}

}  // namespace

void check_aev_inputs(const char* op, const at::Tensor& species, const at::Tensor& pairs,
                      const at::Tensor& diff_vectors, const AEVParams& p) {
  TORCH_CHECK(species.scalar_type() == at::kLong || species.scalar_type() == at::kInt,
              op, ": species must be int64 or int32, got ", species.scalar_type());
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(0) == 2, op,
              ": pairs must have shape (2, P), got ", pairs.sizes());
  TORCH_CHECK(pairs.scalar_type() == at::kLong || pairs.scalar_type() == at::kInt, op,
              ": pairs must be int64 or int32, got ", pairs.scalar_type());
  TORCH_CHECK(diff_vectors.dim() == 2 && diff_vectors.size(1) == 3 &&
                  diff_vectors.size(0) == pairs.size(1),
              op, ": diff_vectors must have shape (P, 3) with P = ", pairs.size(1),
              " pairs, got ", diff_vectors.sizes());
  TORCH_CHECK(at::isFloatingType(diff_vectors.scalar_type()), op,
              ": diff_vectors must be float32 or float64, got ", diff_vectors.scalar_type());
  TORCH_CHECK(p.num_species > 0, op, ": num_species must be positive, got ", p.num_species);
  TORCH_CHECK(p.angular_cutoff > 0 && p.angular_cutoff <= p.radial_cutoff, op,
              ": need 0 < angular_cutoff <= radial_cutoff, got angular_cutoff=",
              p.angular_cutoff, " radial_cutoff=", p.radial_cutoff);
  const int64_t R = p.radial_shifts.numel(), A = p.angular_shifts.numel(),
                Z = p.angular_sections.numel();
  TORCH_CHECK(R > 0 && A > 0 && Z > 0, op, ": empty AEV shifts or sections");
  TORCH_CHECK(p.radial_eta.numel() == 1 || p.radial_eta.numel() == R, op,
              ": radial_eta must have 1 or ", R, " values, got ", p.radial_eta.numel());
  TORCH_CHECK(p.angular_eta.numel() == 1 || p.angular_eta.numel() == A, op,
              ": angular_eta must have 1 or ", A, " values, got ", p.angular_eta.numel());
  TORCH_CHECK(p.angular_zeta.numel() == 1 || p.angular_zeta.numel() == Z, op,
              ": angular_zeta must have 1 or ", Z, " values, got ", p.angular_zeta.numel());
}

namespace {
int64_t aev_length(const AEVParams& p) {
  const int64_t S = p.num_species;
  return S * p.radial_shifts.numel() +
         S * (S + 1) / 2 * p.angular_shifts.numel() * p.angular_sections.numel();
}

at::Tensor species_checked(const char* op, const at::Tensor& species, int64_t num_species) {
  auto s = species.to(at::kLong).contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t i = 0; i < s.numel(); ++i)
    TORCH_CHECK(sp[i] >= -1 && sp[i] < num_species, op, ": species must be -1 (padding) or in [0, ",
                num_species, "), got ", sp[i], " at flattened atom ", i);
  return s;
}
}  // namespace

at::Tensor aev_forward_cpu(const at::Tensor& species, const at::Tensor& pairs,
                           const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev";
  check_aev_inputs(op, species, pairs, diff_vectors, p);
  auto sp = species_checked(op, species, p.num_species);
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  std::vector<int64_t> out_shape(species.sizes().begin(), species.sizes().end());
  out_shape.push_back(aev_length(p));
  auto aev = at::zeros(out_shape, diff.options());
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_forward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = build_half_edges(sp.data_ptr<int64_t>(), N, pr.data_ptr<int64_t>(),
                              pr.data_ptr<int64_t>() + P, diff.data_ptr<scalar_t>(), P,
                              p.radial_cutoff);
    forward_kernel(sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>(), h, k, N,
                   aev.data_ptr<scalar_t>());
  });
  return aev;
}

at::Tensor aev_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const AEVParams& p) {
  const char* op = "torchani_fast::aev_backward";
  check_aev_inputs(op, species, pairs, diff_vectors, p);
  TORCH_CHECK(grad_aev.numel() == species.numel() * aev_length(p), op,
              ": grad_aev must have shape species.shape + (", aev_length(p), ",), got ",
              grad_aev.sizes());
  auto sp = species_checked(op, species, p.num_species);
  auto pr = pairs.to(at::kLong).contiguous();
  auto diff = diff_vectors.contiguous();
  auto g = grad_aev.to(diff.scalar_type()).contiguous();
  const int64_t N = sp.numel(), P = pr.size(1);
  auto grad_diff = at::zeros({P, 3}, diff.options());
  AT_DISPATCH_FLOATING_TYPES(diff.scalar_type(), "aev_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = build_half_edges(sp.data_ptr<int64_t>(), N, pr.data_ptr<int64_t>(),
                              pr.data_ptr<int64_t>() + P, diff.data_ptr<scalar_t>(), P,
                              p.radial_cutoff);
    const int64_t E = h.start[N];
    std::vector<scalar_t> grad_edge(3 * E, scalar_t(0));
    backward_kernel(sp.data_ptr<int64_t>(), diff.data_ptr<scalar_t>(), h, k, N,
                    g.data_ptr<scalar_t>(), grad_edge.data());
    // Back from half edges to pairs: the centre-to-neighbour vector is -diff for
    // the half edge owned by i0 and +diff for the one owned by i1.
    scalar_t* gd = grad_diff.data_ptr<scalar_t>();
    at::parallel_for(0, P, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t e0 = h.edge0[q], e1 = h.edge1[q];
        if (e0 < 0) continue;
        for (int c = 0; c < 3; ++c) gd[3 * q + c] = grad_edge[3 * e1 + c] - grad_edge[3 * e0 + c];
      }
    });
  });
  return grad_diff;
}

}  // namespace torchani_fast
