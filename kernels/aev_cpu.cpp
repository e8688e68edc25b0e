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
