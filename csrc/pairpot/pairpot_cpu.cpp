// CPU kernels of the pair potentials (formulas: pairpot.h).
//
// Each op is a few passes: per-pair terms in parallel (each pair writes its
// own slots), per-atom terms in parallel, and the sums to atoms or molecules
// serially in pair order. A pass of this kind costs a few ns per pair, so
// the serial sums are a small part of the op, and every result is bitwise the
// same for any number of threads.
//
// D3's C6 interpolation is factorised per atom: the reference weights of a
// pair are u_i[a] v_j[b] (the product grid), so with UT_i[t][k][b] =
// sum_a u_i[a] tab[s_i][t][k][a][b] (k = 0: C6 values, 1: the mask), formed
// once per atom and partner element, a pair needs only Z = sum_b UT_i[s_j][0][b]
// v_j[b] and W = sum_b UT_i[s_j][1][b] v_j[b] (and the same with du, dv for the
// derivatives), 4 dot products of 5 instead of 25 exponentials.
#include <ATen/Dispatch.h>

#include <cmath>
#include <vector>

#include "common/parallel.h"
#include "pairpot/pairpot.h"

namespace torchani_fast {

void check_pair_inputs(const char* op, const at::Tensor& elem_idxs, const at::Tensor& pairs,
                       const at::Tensor& distances, const c10::optional<at::Tensor>& ghost_flags,
                       const PairCutoff& cut) {
  TORCH_CHECK(elem_idxs.dim() == 2 && (elem_idxs.scalar_type() == at::kLong ||
                                       elem_idxs.scalar_type() == at::kInt),
              op, ": elem_idxs must be an int64 or int32 (molecules, atoms) tensor, got ",
              elem_idxs.scalar_type(), " ", elem_idxs.sizes());
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(0) == 2 && pairs.scalar_type() == at::kLong, op,
              ": pairs must be an int64 (2, pairs) tensor, got ", pairs.scalar_type(), " ",
              pairs.sizes());
  TORCH_CHECK(distances.dim() == 1 && distances.size(0) == pairs.size(1) &&
                  (distances.scalar_type() == at::kFloat || distances.scalar_type() == at::kDouble),
              op, ": distances must be a float32 or float64 (", pairs.size(1),
              ",) tensor (one per pair), got ", distances.scalar_type(), " ", distances.sizes());
  TORCH_CHECK(elem_idxs.device() == pairs.device() && pairs.device() == distances.device(), op,
              ": elem_idxs, pairs and distances must be on one device, got ", elem_idxs.device(),
              ", ", pairs.device(), " and ", distances.device());
  if (ghost_flags.has_value()) {
    TORCH_CHECK(ghost_flags->numel() == elem_idxs.numel() &&
                    ghost_flags->device() == elem_idxs.device(),
                op, ": ghost_flags must have one entry per atom (", elem_idxs.numel(),
                ") on the device of elem_idxs, got ", ghost_flags->sizes(), " on ",
                ghost_flags->device());
  }
  TORCH_CHECK(cut.kind == kPairCutoffCosine || cut.kind == kPairCutoffSmooth ||
                  cut.kind == kPairCutoffNone,
              op, ": cutoff_kind must be 0 (cosine), 1 (smooth) or 2 (none), got ", cut.kind);
  TORCH_CHECK(cut.cutoff > 0, op, ": cutoff must be > 0, got ", cut.cutoff);
  TORCH_CHECK(cut.kind == kPairCutoffNone || std::isfinite(cut.cutoff), op,
              ": an infinite cutoff needs cutoff_kind 2 (no envelope), got cutoff_kind ",
              cut.kind);
  if (cut.kind == kPairCutoffSmooth) {
    TORCH_CHECK(cut.order >= 1 && cut.order <= 64, op, ": cutoff_order must be in [1, 64] (as for "
                "the AEV), got ", cut.order);
    TORCH_CHECK(cut.eps > 0 && cut.eps < 1, op, ": cutoff_eps must be in (0, 1), got ", cut.eps);
  }
}

namespace {

void check_table(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                 const at::Tensor& distances) {
  TORCH_CHECK(t.sizes() == shape && at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must be a float ", shape, " tensor, got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.device() == distances.device(), op, ": ", name,
              " must be on the device of distances (", distances.device(), "), got ",
              t.device());
}

}  // namespace

void check_repulsion_params(const char* op, const RepulsionParams& p,
                            const at::Tensor& distances) {
  TORCH_CHECK(p.y_ab.dim() == 2 && p.y_ab.size(0) >= 1, op,
              ": y_ab must be an (elements, elements) tensor, got ", p.y_ab.sizes());
  const int64_t T = p.y_ab.size(0);
  check_table(op, "y_ab", p.y_ab, {T, T}, distances);
  check_table(op, "sqrt_alpha_ab", p.sqrt_alpha_ab, {T, T}, distances);
  check_table(op, "k_rep_ab", p.k_rep_ab, {T, T}, distances);
}

void check_d3_params(const char* op, const D3Params& p, const at::Tensor& distances) {
  TORCH_CHECK(p.coeff6.dim() == 4 && p.coeff6.size(0) >= 1 && p.coeff6.size(2) >= 1 &&
                  p.coeff6.size(3) >= 1,
              op, ": coeff6 must be an (elements, elements, refs, refs) tensor, got ",
              p.coeff6.sizes());
  const int64_t T = p.coeff6.size(0);
  const at::IntArrayRef grid = p.coeff6.sizes();
  check_table(op, "coeff6", p.coeff6, {T, T, grid[2], grid[3]}, distances);
  check_table(op, "coordnums_a", p.coordnums_a, grid, distances);
  check_table(op, "coordnums_b", p.coordnums_b, grid, distances);
  check_table(op, "covalent_radii", p.covalent_radii, {T}, distances);
  check_table(op, "sqrt_charge_ab", p.sqrt_charge_ab, {T, T}, distances);
  check_table(op, "cutoff_radii", p.cutoff_radii, {T, T}, distances);
}

namespace {

// The pairs and atoms of a call.
struct PairView {
  const int64_t* first;
  const int64_t* second;
  const int64_t* elem;
  const bool* ghost;  // nullptr without ghost_flags
  int64_t P, N, A;    // pairs, atoms (molecules x atoms per molecule), atoms per molecule
  const char* op;
};

// Whether pair p enters the sums (pairpot.h); raises for an index past the atoms.
template <typename T>
inline bool pair_used(const PairView& v, int64_t p, T r, double cutoff) {
  const int64_t i = v.first[p], j = v.second[p];
  if (i < 0 || j < 0) return false;
  TORCH_CHECK(i < v.N && j < v.N, v.op, ": pairs must index the ", v.N, " atoms, got (", i,
              ", ", j, ")");
  return v.elem[i] >= 0 && v.elem[j] >= 0 && !(r > cutoff);
}

template <typename T>
inline T ghost_factor(const PairView& v, int64_t p) {
  return v.ghost != nullptr && (v.ghost[v.first[p]] || v.ghost[v.second[p]]) ? T(0.5) : T(1);
}

constexpr int64_t kPairGrain = 2048;  // pairs per parallel chunk
constexpr int64_t kAtomGrain = 64;

// The pair energies e (0 for ignored pairs) summed per molecule (M,) or, with
// atomic, half to each atom (M, A); serial, in pair order, in double.
template <typename T>
at::Tensor sum_pair_energies(const PairView& v, const T* e, bool atomic, int64_t M,
                             const at::TensorOptions& options) {
  std::vector<double> acc(atomic ? v.N : M, 0.0);
  for (int64_t p = 0; p < v.P; ++p) {
    const int64_t i = v.first[p], j = v.second[p];
    if (i < 0 || j < 0) continue;
    if (atomic) {
      const double half = static_cast<double>(e[p] / T(2));
      acc[i] += half;
      acc[j] += half;
    } else {
      acc[i / v.A] += static_cast<double>(e[p]);
    }
  }
  at::Tensor out = atomic ? at::empty({M, v.A}, options) : at::empty({M}, options);
  T* o = out.data_ptr<T>();
  for (size_t k = 0; k < acc.size(); ++k) o[k] = static_cast<T>(acc[k]);
  return out;
}

struct Inputs {
  at::Tensor elem, pairs, distances, ghost;
};

Inputs contiguous_inputs(const at::Tensor& elem_idxs, const at::Tensor& pairs,
                         const at::Tensor& distances,
                         const c10::optional<at::Tensor>& ghost_flags) {
  Inputs in{elem_idxs.to(at::kLong).contiguous(), pairs.contiguous(), distances.contiguous(), {}};
  if (ghost_flags.has_value()) in.ghost = ghost_flags->to(at::kBool).reshape(-1).contiguous();
  return in;
}

PairView view_of(const Inputs& in, const char* op) {
  const int64_t P = in.pairs.size(1);
  const int64_t* first = in.pairs.data_ptr<int64_t>();
  return PairView{first,
                  first + P,
                  in.elem.data_ptr<int64_t>(),
                  in.ghost.defined() ? in.ghost.data_ptr<bool>() : nullptr,
                  P,
                  in.elem.numel(),
                  in.elem.size(1),
                  op};
}

// A (T, T) table of one element pair per row-major index, in the dtype T.
template <typename T>
std::vector<T> pair_table(const at::Tensor& t) {
  const at::Tensor c = t.to(c10::CppTypeToScalarType<T>::value).contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> repulsion_xtb_cpu(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const RepulsionParams& p) {
  const char* op = "torchani_fast::repulsion_xtb";
  check_pair_inputs(op, elem_idxs, pairs, distances, ghost_flags, p.cut);
  check_repulsion_params(op, p, distances);
  const Inputs in = contiguous_inputs(elem_idxs, pairs, distances, ghost_flags);
  const PairView v = view_of(in, op);
  const int64_t M = elem_idxs.size(0), Te = p.y_ab.size(0);
  at::Tensor derivs = at::zeros({derivatives ? v.P : 0, 1}, distances.options());
  at::Tensor energies;
  AT_DISPATCH_FLOATING_TYPES(distances.scalar_type(), "repulsion_xtb_cpu", [&] {
    using T = scalar_t;
    const std::vector<T> y = pair_table<T>(p.y_ab), sa = pair_table<T>(p.sqrt_alpha_ab),
                         kr = pair_table<T>(p.k_rep_ab);
    const T* r = in.distances.data_ptr<T>();
    T* der = derivatives ? derivs.data_ptr<T>() : nullptr;
    std::vector<T> e(v.P);
    const T a2b = static_cast<T>(p.angstrom_to_bohr), rmin = static_cast<T>(1e-7);
    torchani_fast::parallel_for(0, v.P, kPairGrain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        if (!pair_used(v, q, r[q], p.cut.cutoff)) {
          e[q] = T(0);
          continue;
        }
        const int64_t si = v.elem[v.first[q]], sj = v.elem[v.second[q]];
        TORCH_CHECK(si < Te && sj < Te, op, ": elem_idxs must be below the tables' ", Te,
                    " elements, got ", si > sj ? si : sj);
        const int64_t t = si * Te + sj;
        const T d = (r[q] < rmin ? rmin : r[q]) * a2b;
        // d ** k: TorchANI's exponents are 1.5 and 1 (equal to rounding to pow).
        const T k = kr[t];
        const T dk = k == T(1) ? d : (k == T(1.5) ? d * std::sqrt(d) : std::pow(d, k));
        const T e0 = y[t] / d * std::exp(-sa[t] * dk);
        T fc, dfc;
        envelope(p.cut, r[q], fc, dfc);
        const T g = ghost_factor<T>(v, q);
        e[q] = g * (e0 * fc);
        if (der != nullptr) {
          // de0/dd = -e0 (1 + sqrt_alpha k d^k) / d; the clamp passes no gradient below 1e-7.
          const T de0 = r[q] >= rmin ? -e0 * (T(1) + sa[t] * k * dk) / d * a2b : T(0);
          der[q] = g * (de0 * fc + e0 * dfc);
        }
      }
    });
    energies = sum_pair_energies<T>(v, e.data(), atomic, M, distances.options());
  });
  return {energies, derivs};
}

std::tuple<at::Tensor, at::Tensor> dispersion_d3_cpu(
    const at::Tensor& elem_idxs, const at::Tensor& pairs, const at::Tensor& distances,
    const c10::optional<at::Tensor>& ghost_flags, bool atomic, bool derivatives,
    const D3Params& p) {
  const char* op = "torchani_fast::dispersion_d3";
  check_pair_inputs(op, elem_idxs, pairs, distances, ghost_flags, p.cut);
  check_d3_params(op, p, distances);
  const Inputs in = contiguous_inputs(elem_idxs, pairs, distances, ghost_flags);
  const PairView v = view_of(in, op);
  const int64_t M = elem_idxs.size(0), N = v.N;
  const int64_t Te = p.coeff6.size(0), Ra = p.coeff6.size(2), Rb = p.coeff6.size(3);
  at::Tensor derivs = at::zeros({derivatives ? v.P : 0, 4}, distances.options());
  at::Tensor energies;
  AT_DISPATCH_FLOATING_TYPES(distances.scalar_type(), "dispersion_d3_cpu", [&] {
    using T = scalar_t;
    const std::vector<T> c6 = pair_table<T>(p.coeff6), cna = pair_table<T>(p.coordnums_a),
                         cnb = pair_table<T>(p.coordnums_b), rcov = pair_table<T>(p.covalent_radii),
                         qab = pair_table<T>(p.sqrt_charge_ab), r0 = pair_table<T>(p.cutoff_radii);
    // Per element: its reference coordination numbers along a and b (the
    // diagonal of the grids: the product grid). Per element pair: the masked
    // C6 table and the mask (T, T, 2, Ra, Rb), the BJ damping radii to the
    // 6th and 8th power, 3 sqrt(Q_a Q_b).
    std::vector<T> ref_a(Te * Ra), ref_b(Te * Rb), tab(Te * Te * 2 * Ra * Rb);
    std::vector<T> damp6(Te * Te), damp8(Te * Te), q3(Te * Te);
    for (int64_t s = 0; s < Te; ++s) {
      for (int64_t a = 0; a < Ra; ++a) ref_a[s * Ra + a] = cna[((s * Te + s) * Ra + a) * Rb];
      for (int64_t b = 0; b < Rb; ++b) ref_b[s * Rb + b] = cnb[(s * Te + s) * Ra * Rb + b];
      for (int64_t t = 0; t < Te; ++t) {
        const int64_t st = s * Te + t;
        for (int64_t ab = 0; ab < Ra * Rb; ++ab) {
          const T c = c6[st * Ra * Rb + ab];
          tab[(st * 2) * Ra * Rb + ab] = c > T(0) ? c : T(0);
          tab[(st * 2 + 1) * Ra * Rb + ab] = c > T(0) ? T(1) : T(0);
        }
        // Only the diagonal's references are read: refuse a grid that is not a product
        // grid where C6 is defined (what d3_unsupported_reason checks in Python).
        for (int64_t a = 0; a < Ra; ++a)
          for (int64_t b = 0; b < Rb; ++b) {
            const int64_t i = st * Ra * Rb + a * Rb + b;
            TORCH_CHECK(!(c6[i] > T(0)) || (cna[i] == ref_a[s * Ra + a] &&
                                            cnb[i] == cnb[(t * Te + t) * Ra * Rb + b]),
                        op, ": the reference coordination numbers must be a product grid "
                        "(coordnums_a[s, t, a, b] = coordnums_a[s, s, a, 0], coordnums_b[s, t, a, b] = "
                        "coordnums_b[t, t, 0, b]); not at (", s, ", ", t, ", ", a, ", ", b, ")");
          }
        const T damp = static_cast<T>(p.a1) * r0[st] + static_cast<T>(p.a2);
        const T damp2 = damp * damp;
        damp6[st] = damp2 * damp2 * damp2;
        damp8[st] = damp6[st] * damp2;
        q3[st] = T(3) * qab[st];
      }
    }
    const T* r = in.distances.data_ptr<T>();
    const T a2b = static_cast<T>(p.angstrom_to_bohr);
    const T k1 = static_cast<T>(p.k1), k2 = static_cast<T>(p.k2), k3 = static_cast<T>(p.k3);
    const T s6 = static_cast<T>(p.s6), s8 = static_cast<T>(p.s8), eps = static_cast<T>(p.eps);

    // 1. The pairs' counting function and its slope (0 for ignored pairs).
    std::vector<T> count(v.P), dcount(derivatives ? v.P : 0);
    std::vector<unsigned char> used(v.P);
    torchani_fast::parallel_for(0, v.P, kPairGrain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        used[q] = pair_used(v, q, r[q], p.cut.cutoff);
        if (!used[q]) {
          count[q] = T(0);
          if (derivatives) dcount[q] = T(0);
          continue;
        }
        const int64_t si = v.elem[v.first[q]], sj = v.elem[v.second[q]];
        TORCH_CHECK(si < Te && sj < Te, op, ": elem_idxs must be below the tables' ", Te,
                    " elements, got ", si > sj ? si : sj);
        const T d = a2b * r[q];
        const T rsum = rcov[si] + rcov[sj];
        const T ex = std::exp(-k1 * (k2 * rsum / d - T(1)));
        const T c = T(1) / (T(1) + ex);
        count[q] = c;
        if (derivatives) dcount[q] = -ex * c * c * k1 * k2 * rsum / (d * d) * a2b;
      }
    });
    // 2. Coordination numbers, serially in pair order.
    std::vector<double> cn_acc(N, 0.0);
    for (int64_t q = 0; q < v.P; ++q) {
      if (!used[q]) continue;
      cn_acc[v.first[q]] += static_cast<double>(count[q]);
      cn_acc[v.second[q]] += static_cast<double>(count[q]);
    }
    // 3. Per atom: the reference weights u (along a) and v (along b), their
    // slopes, and UT = u . tab for every partner element (and dUT = du . tab).
    const int64_t ut_len = Te * 2 * Rb;
    std::vector<T> ut(N * ut_len), vw(N * Rb), dut(derivatives ? N * ut_len : 0),
        dvw(derivatives ? N * Rb : 0);
    torchani_fast::parallel_for(0, N, kAtomGrain, [&](int64_t begin, int64_t end) {
      std::vector<T> u(Ra), du(Ra);
      for (int64_t n = begin; n < end; ++n) {
        const int64_t s = v.elem[n];
        if (s < 0 || s >= Te) continue;  // padding (never read), or refused in step 1
        const T cn = static_cast<T>(cn_acc[n]);
        for (int64_t a = 0; a < Ra; ++a) {
          const T x = cn - ref_a[s * Ra + a];
          u[a] = std::exp(-k3 * (x * x));
          if (derivatives) du[a] = T(-2) * k3 * x * u[a];
        }
        for (int64_t b = 0; b < Rb; ++b) {
          const T x = cn - ref_b[s * Rb + b];
          const T w = std::exp(-k3 * (x * x));
          vw[n * Rb + b] = w;
          if (derivatives) dvw[n * Rb + b] = T(-2) * k3 * x * w;
        }
        for (int64_t tk = 0; tk < Te * 2; ++tk) {
          const T* tb = tab.data() + (s * Te * 2 + tk) * Ra * Rb;
          T* o = ut.data() + n * ut_len + tk * Rb;
          T* od = derivatives ? dut.data() + n * ut_len + tk * Rb : nullptr;
          for (int64_t b = 0; b < Rb; ++b) {
            T acc = T(0);
            for (int64_t a = 0; a < Ra; ++a) acc += u[a] * tb[a * Rb + b];
            o[b] = acc;
          }
          if (od == nullptr) continue;
          for (int64_t b = 0; b < Rb; ++b) {
            T dacc = T(0);
            for (int64_t a = 0; a < Ra; ++a) dacc += du[a] * tb[a * Rb + b];
            od[b] = dacc;
          }
        }
      }
    });
    // 4. Per pair: C6, the damped energy and the factors of the gradient.
    std::vector<T> e(v.P);
    T* der = derivatives ? derivs.data_ptr<T>() : nullptr;
    torchani_fast::parallel_for(0, v.P, kPairGrain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        if (!used[q]) {
          e[q] = T(0);
          continue;
        }
        const int64_t i = v.first[q], j = v.second[q];
        const int64_t si = v.elem[i], sj = v.elem[j], st = si * Te + sj;
        const T* u0 = ut.data() + i * ut_len + sj * 2 * Rb;  // UT_i[s_j][0], then [1]
        const T* vj = vw.data() + j * Rb;
        T z = T(0), w = T(0);
        for (int64_t b = 0; b < Rb; ++b) {
          z += u0[b] * vj[b];
          w += u0[Rb + b] * vj[b];
        }
        z += eps;
        w += eps;
        const T c6q = z / w;
        const T d = a2b * r[q];
        const T d2 = d * d, d6 = d2 * d2 * d2, d8 = d6 * d2;
        const T t6 = s6 / (d6 + damp6[st]), t8 = s8 * q3[st] / (d8 + damp8[st]);
        T fc, dfc;
        envelope(p.cut, r[q], fc, dfc);
        const T h = -(t6 + t8) * fc;
        const T g = ghost_factor<T>(v, q);
        e[q] = g * (c6q * h);
        if (der != nullptr) {
          // dh/dr: d/dd (1 / (d^n + D^n)) = -n d^(n-1) / (d^n + D^n)^2
          const T dh = (t6 * T(6) * d2 * d2 * d / (d6 + damp6[st]) +
                        t8 * T(8) * d6 * d / (d8 + damp8[st])) * a2b * fc -
                       (t6 + t8) * dfc;
          const T* du0 = dut.data() + i * ut_len + sj * 2 * Rb;
          const T* dvj = dvw.data() + j * Rb;
          T dzi = T(0), dwi = T(0), dzj = T(0), dwj = T(0);
          for (int64_t b = 0; b < Rb; ++b) {
            dzi += du0[b] * vj[b];
            dwi += du0[Rb + b] * vj[b];
            dzj += u0[b] * dvj[b];
            dwj += u0[Rb + b] * dvj[b];
          }
          T* o = der + 4 * q;
          o[0] = g * c6q * dh;
          o[1] = g * h * ((dzi - c6q * dwi) / w);
          o[2] = g * h * ((dzj - c6q * dwj) / w);
          o[3] = dcount[q];
        }
      }
    });
    energies = sum_pair_energies<T>(v, e.data(), atomic, M, distances.options());
  });
  return {energies, derivs};
}

at::Tensor pair_energies_backward_cpu(const at::Tensor& grad_energies, const at::Tensor& derivs,
                                      const at::Tensor& pairs, const at::Tensor& elem_idxs,
                                      bool atomic) {
  const char* op = "torchani_fast::pair_energies_backward";
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(0) == 2 && pairs.scalar_type() == at::kLong, op,
              ": pairs must be an int64 (2, pairs) tensor, got ", pairs.scalar_type(), " ",
              pairs.sizes());
  const int64_t P = pairs.size(1);
  TORCH_CHECK(derivs.dim() == 2 && derivs.size(0) == P &&
                  (derivs.size(1) == 1 || derivs.size(1) == 4) &&
                  at::isFloatingType(derivs.scalar_type()),
              op, ": derivs must be a float (", P, ", 1) or (", P, ", 4) tensor, got ",
              derivs.scalar_type(), " ", derivs.sizes());
  TORCH_CHECK(grad_energies.scalar_type() == derivs.scalar_type(), op,
              ": grad_energies must have the dtype of derivs (", derivs.scalar_type(), "), got ",
              grad_energies.scalar_type());
  TORCH_CHECK(elem_idxs.dim() == 2, op, ": elem_idxs must be (molecules, atoms), got ",
              elem_idxs.sizes());
  const int64_t M = elem_idxs.size(0), A = elem_idxs.size(1), num_atoms = M * A;
  const bool shape_ok = atomic ? grad_energies.sizes() == elem_idxs.sizes()
                               : grad_energies.dim() == 1 && grad_energies.size(0) == M;
  TORCH_CHECK(shape_ok, op, ": grad_energies must have the energies' shape, ",
              atomic ? "(molecules, atoms) = " : "(molecules,) of ", elem_idxs.sizes(), ", got ",
              grad_energies.sizes());
  const at::Tensor idx = pairs.contiguous(), g_c = grad_energies.contiguous(),
                   der_c = derivs.contiguous();
  const int64_t* first = idx.data_ptr<int64_t>();
  const int64_t* second = first + P;
  for (int64_t q = 0; q < P; ++q)
    TORCH_CHECK(first[q] < num_atoms && second[q] < num_atoms, op, ": pairs must index the ",
                num_atoms, " atoms, got (", first[q], ", ", second[q], ")");
  const int64_t K = derivs.size(1);
  at::Tensor grad = at::empty({P}, derivs.options());
  AT_DISPATCH_FLOATING_TYPES(derivs.scalar_type(), "pair_energies_backward_cpu", [&] {
    using T = scalar_t;
    const T* g = g_c.data_ptr<T>();
    const T* der = der_c.data_ptr<T>();
    T* out = grad.data_ptr<T>();
    auto weight = [&](int64_t q) -> T {
      const int64_t i = first[q], j = second[q];
      return atomic ? T(0.5) * (g[i] + g[j]) : g[i / A];
    };
    if (K == 1) {
      torchani_fast::parallel_for(0, P, kPairGrain, [&](int64_t begin, int64_t end) {
        for (int64_t q = begin; q < end; ++q)
          out[q] = first[q] < 0 || second[q] < 0 ? T(0) : weight(q) * der[q];
      });
      return;
    }
    // G_a = sum over a's pairs of w dE/dcn_a, serially in pair order.
    std::vector<double> G(num_atoms, 0.0);
    for (int64_t q = 0; q < P; ++q) {
      if (first[q] < 0 || second[q] < 0) continue;
      const T w = weight(q);
      G[first[q]] += static_cast<double>(w * der[4 * q + 1]);
      G[second[q]] += static_cast<double>(w * der[4 * q + 2]);
    }
    torchani_fast::parallel_for(0, P, kPairGrain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t i = first[q], j = second[q];
        if (i < 0 || j < 0) {
          out[q] = T(0);
          continue;
        }
        const T* o = der + 4 * q;
        out[q] = weight(q) * o[0] + static_cast<T>(G[i] + G[j]) * o[3];
      }
    });
  });
  return grad;
}

}  // namespace torchani_fast
