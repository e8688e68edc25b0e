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

#include "aev_cpu_common.h"

namespace torchani_fast {

using namespace aev_cpu_detail;

namespace {

template <typename scalar_t>
void forward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                    const Consts<scalar_t>& k, int64_t num_atoms, scalar_t* aev) {
  at::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), f2(k.A), fc_a;
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
      fc_a.resize(ang.size());
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
    std::vector<scalar_t> f1(k.Z), df1(k.Z), f2(k.A), df2(k.A), fc_a, dfc_a;
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
      fc_a.resize(na);
      dfc_a.resize(na);
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


at::Tensor aev_forward_cpu(const at::Tensor& species, const at::Tensor& pairs,
                           const at::Tensor& diff_vectors, const AEVParams& p) {
  const AevInputs in("torchani_fast::aev", species, pairs, diff_vectors, p);
  auto aev = at::zeros(aev_shape(species, p), in.diff.options());
  AT_DISPATCH_FLOATING_TYPES(in.diff.scalar_type(), "aev_forward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p.radial_cutoff);
    forward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), h, k, in.N,
                   aev.data_ptr<scalar_t>());
  });
  return aev;
}

at::Tensor aev_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const AEVParams& p) {
  const char* op = "torchani_fast::aev_backward";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_grad_aev(op, grad_aev, species, p);
  auto g = in.working(grad_aev);
  auto grad_diff = at::zeros({in.P, 3}, in.diff.options());
  AT_DISPATCH_FLOATING_TYPES(in.diff.scalar_type(), "aev_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = in.half_edges<scalar_t>(p.radial_cutoff);
    std::vector<scalar_t> grad_edge(3 * h.start[in.N], scalar_t(0));
    backward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), h, k, in.N,
                    g.data_ptr<scalar_t>(), grad_edge.data());
    edges_to_pairs(h, grad_edge.data(), in.P, grad_diff.data_ptr<scalar_t>());
  });
  return grad_diff;
}

}  // namespace torchani_fast
