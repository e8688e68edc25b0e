// CPU AEV from a half neighbour list: forward and backward, parallel over atoms.
//
// Each pair p = (i0, i1) with diff_vectors[p] = x[i0] - x[i1] (+ lattice shift)
// is expanded into two "half edges", one owned by each atom. An atom only ever
// writes its own AEV row (forward) and the gradients of its own half edges
// (backward), so the parallel loop over atoms needs no atomics and gives the same
// bits for any number of threads.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "aev/half_edges.h"
#include "aev/vector_cpu.h"
#include "common/tensor_id.h"
#include "common/workspace.h"
#include "common/parallel.h"
#include "common/simd_math.h"

namespace torchani_fast {

using namespace aev_cpu_detail;

namespace {

// The angular cutoff of each angular neighbour; for the backward (dfc and
// inv_r given, else both null) also its derivative and 1 / r (0 for r = 0), so
// that a triple's gradient needs no division.
template <typename scalar_t>
inline void angular_cutoffs(const std::vector<Neighbor<scalar_t>>& ang, scalar_t rc,
                            const aev_math::CutoffFn<scalar_t>& cut, std::vector<scalar_t>& fc, std::vector<scalar_t>* dfc,
                            std::vector<scalar_t>* inv_r) {
  fc.resize(ang.size());
  for (size_t j = 0; j < ang.size(); ++j) fc[j] = aev_math::cutoff_value(cut, ang[j].r, rc);
  if (dfc == nullptr) return;
  dfc->resize(ang.size());
  inv_r->resize(ang.size());
  for (size_t j = 0; j < ang.size(); ++j) {
    (*dfc)[j] = aev_math::cutoff_deriv(cut, ang[j].r, rc);
    (*inv_r)[j] = ang[j].r > 0 ? scalar_t(1) / ang[j].r : scalar_t(0);
  }
}

// The gradient of one angular triple on its two half edges, from the sums over
// its AEV block (g = grad_aev): s_val = sum g f, s_dc = sum g df/dc and
// s_dm = sum g df/d(mean r) without the cutoffs; fc1, fc2, dfc1, dfc2 and
// inv1, inv2 are the two neighbours' angular cutoffs, their derivatives and 1 / r.
template <typename scalar_t>
inline void add_triple_grad(const Neighbor<scalar_t>& n1, const Neighbor<scalar_t>& n2,
                            const aev_math::Triple<scalar_t>& t, scalar_t fc1, scalar_t fc2,
                            scalar_t dfc1, scalar_t dfc2, scalar_t inv1, scalar_t inv2,
                            scalar_t s_val, scalar_t s_dc, scalar_t s_dm, scalar_t* grad_edge) {
  const scalar_t fcc = fc1 * fc2;
  // d/d(cos_raw) through c = 0.95 cos_raw; d/dr_i through the mean distance
  // (factor 1/2) and through the cutoff of that neighbour.
  const scalar_t d_cos = scalar_t(0.95) * fcc * s_dc;
  const scalar_t d_r1 = scalar_t(0.5) * fcc * s_dm + s_val * dfc1 * fc2;
  const scalar_t d_r2 = scalar_t(0.5) * fcc * s_dm + s_val * fc1 * dfc2;
  // g1 = d_cos dq/dv1 + d_r1 v1 / r1 with dq/dv1 = v2 / (r1 r2) - q v1 / r1^2
  // (q = cos_raw; v2 1e10 once clamped), as coefficients of v1 and v2.
  scalar_t c12, c1 = d_r1 * inv1, c2 = d_r2 * inv2;
  if (t.clamped) {
    c12 = d_cos * scalar_t(1e10);
  } else {
    c12 = d_cos * inv1 * inv2;
    c1 -= d_cos * t.cos_raw * inv1 * inv1;
    c2 -= d_cos * t.cos_raw * inv2 * inv2;
  }
  scalar_t* g1 = grad_edge + 3 * n1.edge;
  scalar_t* g2 = grad_edge + 3 * n2.edge;
  for (int c = 0; c < 3; ++c) {
    g1[c] += c12 * n2.v[c] + c1 * n1.v[c];
    g2[c] += c12 * n1.v[c] + c2 * n2.v[c];
  }
}


// Whether the vectorised kernels compute this AEV (their half edges carry
// vectors: build_half_edges).
template <typename scalar_t>
bool vector_kernels(const Consts<scalar_t>& k) {
#ifdef TF_SIMD_AVX2
  return vector_path(k);
#else
  return false;
#endif
}

template <typename scalar_t>
void forward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                    const Consts<scalar_t>& k, int64_t num_atoms, scalar_t* aev) {
#ifdef TF_SIMD_AVX2
  if (h.vectors) {
    const bool wide = simd::have_avx512();
    torchani_fast::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
      const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);  // (float64 keeps denormals)
      forward_atoms_vector(begin, end, species, h, k, aev, wide);
    });
    return;
  }
#endif
  torchani_fast::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), f2(k.A), fc_a;
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* row = aev + i * k.F;
      std::fill(row, row + k.F, scalar_t(0));  // (the output is allocated uninitialised)
      if (species[i] < 0) continue;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        const scalar_t fc = aev_math::cutoff_value(k.cut, n.r, k.rc_r);
        scalar_t* out = row + n.species * k.R;
        for (int64_t s = 0; s < k.R; ++s) {
          const scalar_t x = n.r - k.shf_r[s];
          out[s] += scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x) * fc;
        }
        if (n.r <= k.rc_a) ang.push_back(n);
      }
      angular_cutoffs<scalar_t>(ang, k.rc_a, k.cut, fc_a, nullptr, nullptr);
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

// The half-edge gradients of atoms [begin, end), zeroed by the thread that
// then adds to them (each atom writes only its own half edges).
template <typename scalar_t>
void zero_edges(const HalfEdges& h, int64_t begin, int64_t end, scalar_t* grad_edge) {
  std::fill(grad_edge + 3 * h.start[begin], grad_edge + 3 * h.start[end], scalar_t(0));
}

template <typename scalar_t>
void backward_kernel(const int64_t* species, const scalar_t* diff, const HalfEdges& h,
                     const Consts<scalar_t>& k, int64_t num_atoms, const scalar_t* grad_aev,
                     scalar_t* grad_edge) {
#ifdef TF_SIMD_AVX2
  if (h.vectors) {
    const bool wide = simd::have_avx512();
    torchani_fast::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
      const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
      zero_edges(h, begin, end, grad_edge);
      backward_atoms_vector(begin, end, species, h, k, grad_aev, grad_edge, wide);
    });
    return;
  }
#endif
  torchani_fast::parallel_for(0, num_atoms, 8, [&](int64_t begin, int64_t end) {
    const simd::FlushDenormals flush(std::is_same_v<scalar_t, float>);
    zero_edges(h, begin, end, grad_edge);
    std::vector<Neighbor<scalar_t>> nbrs, ang;
    std::vector<scalar_t> f1(k.Z), df1(k.Z), f2(k.A), df2(k.A), fc_a, dfc_a, inv_r;
    for (int64_t i = begin; i < end; ++i) {
      if (species[i] < 0) continue;
      const scalar_t* grow = grad_aev + i * k.F;
      gather_neighbors(h, i, species, diff, nbrs);
      ang.clear();
      for (const auto& n : nbrs) {
        scalar_t* ge = grad_edge + 3 * n.edge;
        if (n.r <= k.rc_a) ang.push_back(n);
        if (!(n.r > 0)) continue;  // coincident atoms: the direction is undefined
        const scalar_t fc = aev_math::cutoff_value(k.cut, n.r, k.rc_r);
        const scalar_t dfc = aev_math::cutoff_deriv(k.cut, n.r, k.rc_r);
        const scalar_t* g = grow + n.species * k.R;
        scalar_t dr = 0;
        for (int64_t s = 0; s < k.R; ++s) {
          const scalar_t x = n.r - k.shf_r[s];
          const scalar_t e = scalar_t(0.25) * std::exp(-k.eta_r[s] * x * x);
          dr += g[s] * e * (dfc - scalar_t(2) * k.eta_r[s] * x * fc);
        }
        const scalar_t dr_r = dr / n.r;
        for (int c = 0; c < 3; ++c) ge[c] += dr_r * n.v[c];
      }
      const size_t na = ang.size();
      angular_cutoffs(ang, k.rc_a, k.cut, fc_a, &dfc_a, &inv_r);
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
          add_triple_grad(n1, n2, t, fc_a[j], fc_a[l], dfc_a[j], dfc_a[l], inv_r[j], inv_r[l],
                          s_val, s_dc, s_dm, grad_edge);
        }
      }
    }
  });
}

// The forward's half edges, handed to the backward of the same call through
// autograd (the Autograd kernel of `aev` calls aev_with_edges and saves the
// handle in its context; autograd.cpp), so that the backward does not build
// them again (for 3 000 waters that build was 0.5-0.8 ms of a 32 ms energy +
// forces call at 2 threads). The handle is a (0,) uint8 tensor whose storage
// owns the half edges: it holds no data a copy could carry, and only a tensor
// made here (its DataPtr's deleter is delete_kept_edges) is read back. Half
// edges over kMaxBytes (about 50 000 atoms of water: 120 MB held through the
// networks for a box of 98 304, 9% more peak memory) are not kept. The
// backward uses them only for the very tensors they were built from: the same
// TensorImpl (referenced weakly, so that a new tensor at a freed one's address
// cannot match), version, data pointer, sizes and strides, the same cutoff,
// species count and layout; any other call builds its own.
struct KeptEdges {
  std::shared_ptr<const HalfEdges> edges;
  TensorId species, pairs, diff;
  double cutoff;
  int64_t num_species;

  bool matches(const at::Tensor& s, const at::Tensor& pr, const at::Tensor& d,
               const AEVParams& p, bool vectors) const {
    return species.same(s) && pairs.same(pr) && diff.same(d) && cutoff == p.radial_cutoff &&
           num_species == p.num_species && edges->vectors == vectors;
  }
};

constexpr size_t kMaxKeptBytes = size_t(64) << 20;

void delete_kept_edges(void* context) { delete static_cast<KeptEdges*>(context); }

// The handle of `edges` built from these inputs, or an empty tensor where they
// are not kept (inference tensors, too large).
at::Tensor edges_handle(const at::Tensor& species, const at::Tensor& pairs,
                        const at::Tensor& diff, const AEVParams& p,
                        std::shared_ptr<const HalfEdges> edges) {
  const auto options = at::TensorOptions().dtype(at::kByte);
  if (species.is_inference() || pairs.is_inference() || diff.is_inference() ||
      edges->bytes() > kMaxKeptBytes)
    return at::empty({0}, options);
  auto* kept = new KeptEdges{std::move(edges), TensorId(species), TensorId(pairs), TensorId(diff),
                             p.radial_cutoff, p.num_species};
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(kept, kept, &delete_kept_edges, at::Device(at::kCPU)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, options).set_(storage);
}

// The half edges a handle holds, if it is one of ours and was built from these
// inputs in this layout; else null.
const HalfEdges* kept_edges(const at::Tensor& handle, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff, const AEVParams& p,
                            bool vectors) {
  if (!handle.defined() || !handle.has_storage()) return nullptr;
  const c10::DataPtr& ptr = handle.storage().data_ptr();
  if (ptr.get_deleter() != &delete_kept_edges) return nullptr;
  const auto* kept = static_cast<const KeptEdges*>(ptr.get_context());
  return kept->matches(species, pairs, diff, p, vectors) ? kept->edges.get() : nullptr;
}

// The forward, with the handle of its half edges when `keep`.
std::tuple<at::Tensor, at::Tensor> aev_forward_impl(const at::Tensor& species,
                                                    const at::Tensor& pairs,
                                                    const at::Tensor& diff_vectors,
                                                    const AEVParams& p, bool keep) {
  const AevInputs in("torchani_fast::aev", species, pairs, diff_vectors, p);
  // Every row is written by the kernel; the memory from the caller's workspace, if any.
  auto aev = output_empty(Workspace::kAev, aev_shape(species, p), in.diff.options());
  at::Tensor handle;
  AT_DISPATCH_FLOATING_TYPES(in.diff.scalar_type(), "aev_forward_cpu", [&] {
    Consts<scalar_t> k(p);
    auto h = std::make_shared<const HalfEdges>(in.half_edges<scalar_t>(p, vector_kernels(k)));
    forward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), *h, k, in.N,
                   aev.data_ptr<scalar_t>());
    if (keep) handle = edges_handle(species, pairs, diff_vectors, p, std::move(h));
  });
  if (!handle.defined()) handle = at::empty({0}, at::TensorOptions().dtype(at::kByte));
  return {aev, handle};
}

}  // namespace

void check_cutoff_fn(const char* op, int64_t cutoff_kind, int64_t cutoff_order,
                     double cutoff_eps) {
  TORCH_CHECK(cutoff_kind == aev_math::kCutoffCosine || cutoff_kind == aev_math::kCutoffSmooth,
              op, ": cutoff_kind must be 0 (cosine) or 1 (smooth), got ", cutoff_kind);
  if (cutoff_kind != aev_math::kCutoffSmooth) return;
  TORCH_CHECK(cutoff_order >= 1 && cutoff_order <= 64, op,
              ": cutoff_order of the smooth cutoff must be in [1, 64], got ", cutoff_order);
  TORCH_CHECK(cutoff_eps > 0 && cutoff_eps < 1, op,
              ": cutoff_eps of the smooth cutoff must be in (0, 1), got ", cutoff_eps);
}

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
  check_cutoff_fn(op, p.cutoff_kind, p.cutoff_order, p.cutoff_eps);
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
  return std::get<0>(aev_forward_impl(species, pairs, diff_vectors, p, false));
}

std::tuple<at::Tensor, at::Tensor> aev_with_edges_cpu(const at::Tensor& species,
                                                      const at::Tensor& pairs,
                                                      const at::Tensor& diff_vectors,
                                                      const AEVParams& p) {
  return aev_forward_impl(species, pairs, diff_vectors, p, true);
}

at::Tensor aev_backward_edges_cpu(const at::Tensor& grad_aev, const at::Tensor& edges,
                                  const at::Tensor& species, const at::Tensor& pairs,
                                  const at::Tensor& diff_vectors, const AEVParams& p) {
  const char* op = "torchani_fast::aev_backward";
  const AevInputs in(op, species, pairs, diff_vectors, p);
  check_grad_aev(op, grad_aev, species, p);
  auto g = in.working(grad_aev);
  auto grad_diff = at::empty({in.P, 3}, in.diff.options());  // every row written by edges_to_pairs
  AT_DISPATCH_FLOATING_TYPES(in.diff.scalar_type(), "aev_backward_cpu", [&] {
    Consts<scalar_t> k(p);
    const HalfEdges* kept = kept_edges(edges, species, pairs, diff_vectors, p, vector_kernels(k));
    HalfEdges built;
    if (!kept) built = in.half_edges<scalar_t>(p, vector_kernels(k));
    const HalfEdges& h = kept ? *kept : built;
    UninitVector<scalar_t> grad_edge(3 * h.start[in.N]);  // zeroed by backward_kernel
    backward_kernel(in.species.data_ptr<int64_t>(), in.diff.data_ptr<scalar_t>(), h, k, in.N,
                    g.data_ptr<scalar_t>(), grad_edge.data());
    edges_to_pairs(h, grad_edge.data(), in.P, grad_diff.data_ptr<scalar_t>());
  });
  return grad_diff;
}

at::Tensor aev_backward_cpu(const at::Tensor& grad_aev, const at::Tensor& species,
                            const at::Tensor& pairs, const at::Tensor& diff_vectors,
                            const AEVParams& p) {
  return aev_backward_edges_cpu(grad_aev, at::Tensor(), species, pairs, diff_vectors, p);
}

}  // namespace torchani_fast
