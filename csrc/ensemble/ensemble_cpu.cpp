// Fused ensemble networks on the CPU (torchani_fast/nn.py, FusedEnsemble).
//
// ensemble_mlp evaluates, for every element group of atoms and every member of
// the ensemble, the element network (Linear -> CELU(0.1) -> ... -> Linear(1))
// and, in the same pass, the input gradient of the members' sum,
//   J = d(sum_members out) / d(used AEV columns)   (n_group, K_group),
// which is all the backward of an ensemble-mean energy (forces) needs
// (ensemble_mlp_backward, ensemble/input_grad_cpu.cpp).
//
// One task is (group, block of up to kBlockRows atoms, slice of the members):
// the blocks of a group are of even size. A task gathers its rows of the AEV
// once, then runs each member's forward and backward back to back, one thread
// per task. Inputs of few blocks also split
// the members into slices, so that every thread has work; the split depends on
// the input only, and results do not depend on the number of threads.
// On AVX2 CPUs both dtypes multiply with the weights' panel copies: float32
// with W for the forward and W^T for the backward (with AVX-512 the backward
// too reads W, ensemble/gemm.h, except in groups of many blocks), float64 with
// W and W^T (ensemble/gemm_f64.h); otherwise BLAS.
//
// The activation (`activation`, small_gemm::Activation; ensemble/activations.h)
// is CELU(0.1) or GELU.
// CELU(alpha) = x for x > 0, alpha expm1(x / alpha) otherwise; its derivative
// is kept from the forward pass. On AVX2 CPUs float32 uses common/simd_math.h's
// exp (about 1 ulp), float64 simd_math_f64.h's (within 1 ulp); elsewhere
// std::expm1/std::exp. float64 reproduces PyTorch's backward, which scales by
// 1/float32(alpha) (see nn.py).
// GELU(x) = x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2, derivative
// Phi(x) + x exp(-x^2 / 2) / sqrt(2 pi): float32 through simd::gelu (a
// polynomial erfc, common/simd_math.h), float64 with std::erf / std::exp in
// PyTorch's formulas. Layers without biases come with zero biases (nn/fused.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/parallel.h"
#include "common/simd_math.h"
#include "ensemble/activations.h"
#include "ensemble/gemm.h"
#include "ensemble/gemm_f64.h"
#include "ensemble/zero_chunks.h"
#include "ops.h"

namespace torchani_fast {
namespace {

void at_parallel_for(int64_t begin, int64_t end, int64_t grain,
                     const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(begin, end, grain, fn);
}

using namespace ensemble_detail;
using namespace ensemble_activations;

constexpr int64_t kBlockRows = 96;     // at most this many atoms per task
constexpr int64_t kTargetTasks = 16;  // below this many blocks, members are split too
// Up to this many rows a block's backward reads the forward panels (W, just
// used by the forward pass) instead of W^T's: 3-atom water 1.65 -> 1.47 ms per
// call; no gain from 4 rows up (2iuz, interleaved A/B).
constexpr int64_t kNtMaxRows = 2;
// With AVX-512 a block's backward transposes W into L1 (panel_nt), so that a
// call reads only W's bytes: small molecules read each weight once per call,
// often from memory (after another program ran), and W^T would be as many
// bytes again. A group of at least kStoredMinBlocks blocks multiplies by the
// stored W^T panels instead (no transposes; the same bits) when all the
// call's panels, with those W^T, take at most kStoredMaxBytes, so that they
// stay in a server CPU's L3 from block to block. One core, 60-96 rows of
// 128-256-192-160 in cache: the backward 206-222 -> 224-237 GFLOP/s. 3 000
// waters (H and O: 6 MB of W, 6 of W^T), the networks stage, median ms of
// alternating processes: 2 threads 24.9-26.5 -> 24.7-25.7 (5 of 6 rounds
// faster), 1 thread 47.9-51.4 -> 47.7-49.5.
constexpr int64_t kStoredMinBlocks = 3;
constexpr int64_t kStoredMaxBytes = int64_t(16) << 20;

// ---------------------------------------------------------------------------
// The networks of one group, all members.
// ---------------------------------------------------------------------------

template <typename T>
struct GroupNet {
  int64_t rows_begin;   // first entry of the group in atoms
  int64_t rows;         // atoms in the group
  int64_t jac_offset;   // first element of its J in the flat output
  int64_t blocks = 0;   // blocks of rows (tasks per slice of the members)
  int64_t act = small_gemm::kCelu01;  // the activation between layers
  bool stored_wt = false;  // the backward multiplies by the stored W^T panels
  // The used AEV columns (K of them) as runs of consecutive columns:
  // (first AEV column, first of the K, length).
  std::vector<std::array<int64_t, 3>> runs;
  std::vector<int64_t> dims;     // K, d1, ..., d_L (= 1)
  std::vector<const T*> weight;  // per layer: member 0's weights (d_in, d_out), row-major
  std::vector<int64_t> ld;       // per layer: row stride of the weights
  std::vector<int64_t> stride;   // per layer: offset from one member's weights to the next
  std::vector<const T*> bias;    // per layer: member 0's bias
  // Panels (or empty): per hidden layer, member 0's W (forward) and W^T
  // (backward) as 16-column panels (ensemble/gemm.h, gemm_f64.h); member
  // stride d_in * d_out.
  std::vector<const T*> panel_fwd, panel_bwd;
  // A float64 network's layers whose panels came in float32 (weights that are
  // float32 values: gemm_f64.h widens them in cache): those panels, and
  // nullptr in panel_fwd / panel_bwd; nullptr here for the other layers.
  std::vector<const float*> narrow_fwd, narrow_bwd;
  // fn(W's panels, W^T's panels) of layer l, whichever dtype they have.
  template <typename Fn>
  auto with_panels(int64_t l, Fn&& fn) const {
    if (narrow_fwd[l] != nullptr) return fn(narrow_fwd[l], narrow_bwd[l]);
    return fn(panel_fwd[l], panel_bwd[l]);
  }
  int64_t layers() const { return static_cast<int64_t>(weight.size()); }
  int64_t in_dim() const { return dims[0]; }
};

struct Task {
  int64_t group, row0, rows, slice;
};

// Layer l of member m: out (rows, d_out) = h W_l + b_l, then, if deriv is
// given, CELU in place with its derivative into deriv (the panel kernels apply
// it to their accumulators before storing them). With the panels, `chunks`
// (per row, or nullptr) are h's 16-column chunks that are not all zero, and
// the product prefetches the first weights read after it (panel_gemm's
// `next`): the next layer's first 64 columns, or after the last panel layer
// those of the first layer of member next_m (if >= 0). Weights that come from
// memory (as in the first call after another program's) then arrive while the
// tiles run. One core, one member of 384-256-192-160 (forward and J), weights
// from memory, us: 22 rows 96-98 -> 87-92, 60 rows 216-231 -> 206-218, 96 rows
// 328-336 -> 318-322 (weights in cache: 77-80, 192-195, 300-314, unchanged).
template <typename T>
void layer_forward(const GroupNet<T>& net, int64_t l, int64_t m, int64_t rows, const T* h, T* out,
                   const uint64_t* chunks, T* deriv, int64_t next_m) {
  const int64_t din = net.dims[l], dout = net.dims[l + 1];
  const T* bias = net.bias[l] + m * dout;
  const int64_t panels = static_cast<int64_t>(net.panel_fwd.size());
  if (l < panels) {
    // (A prefetch hint: the first `count` weights of member nm's layer nl, as
    // that many bytes of T, whatever the panels' dtype.)
    const T* next = nullptr;
    int64_t next_values = 0;
    auto ahead = [&](int64_t nl, int64_t nm, int64_t count) {
      net.with_panels(nl, [&](auto w, auto) {
        next = reinterpret_cast<const T*>(w + nm * net.dims[nl] * net.dims[nl + 1]);
        next_values = count * static_cast<int64_t>(sizeof(*w)) / static_cast<int64_t>(sizeof(T));
      });
    };
    if (l + 1 < panels) {
      ahead(l + 1, m, std::min<int64_t>(64, net.dims[l + 2]) * dout);
    } else if (next_m >= 0) {
      ahead(0, next_m, std::min<int64_t>(64, net.dims[1]) * net.dims[0]);
    }
    net.with_panels(l, [&](auto w, auto) {  // T, or float32 panels of a float64 network
      if constexpr (std::is_same_v<T, float>) {
        small_gemm::panel_gemm(rows, dout, din, h, din, w + m * din * dout, bias, false, nullptr, 0,
                               out, dout, chunks, nullptr, deriv, next, next_values, net.act);
      } else {
        small_gemm::panel_gemm_f64(rows, dout, din, h, din, w + m * din * dout, bias, false,
                                   nullptr, 0, out, dout, chunks, nullptr, deriv, next,
                                   next_values, net.act);
      }
    });
    return;
  }
  small_gemm::gemm_bias<T>(rows, dout, din, h, din, net.weight[l] + m * net.stride[l], net.ld[l],
                           bias, out, dout);
  if (deriv != nullptr) activation_inplace(net.act, out, deriv, rows * dout);
}

// Back through layer l of member m: out (rows, d_in) = (g W_l^T) * deriv, or,
// without deriv, out = g W_l^T (accumulate: out += g W_l^T). With the panels,
// out's 16-column chunks not in `chunks` (per row, or nullptr) are 0 (or kept).
template <typename T>
void layer_backward(const GroupNet<T>& net, int64_t l, int64_t m, int64_t rows, const T* g,
                    const T* deriv, bool accumulate, T* out, const uint64_t* chunks) {
  const int64_t din = net.dims[l], dout = net.dims[l + 1];
  if constexpr (std::is_same_v<T, float>) {
    // With AVX-512 a block's backward reads the forward panels (W, just used
    // by the forward pass and still in cache) and not W^T's (blocks of up to
    // 8 rows with dot products, larger ones through W^T panels made on the
    // fly in L1): half the weight bytes per call, which matter when they come
    // from memory (right after another program ran, as in the interleaved
    // benchmark). Groups of many blocks whose weights stay in L3 read the
    // stored W^T (stored_wt, kStoredMinBlocks).
    const bool from_w = rows <= kNtMaxRows ||
                        (!net.stored_wt && small_gemm::panel_nt_any_rows(din, dout));
    if (from_w && l < static_cast<int64_t>(net.panel_fwd.size())) {
      small_gemm::panel_nt(rows, din, dout, g, dout, net.panel_fwd[l] + m * din * dout, accumulate,
                           deriv, din, out, din, chunks);
      return;
    }
    if (l < static_cast<int64_t>(net.panel_bwd.size())) {
      small_gemm::panel_gemm(rows, din, dout, g, dout, net.panel_bwd[l] + m * din * dout, nullptr,
                             accumulate, deriv, din, out, din, nullptr, chunks);
      return;
    }
  } else {
    // With AVX-512 a group of fewer than kStoredMinBlocks blocks makes W^T's
    // panels from W's in L1 (panel_nt_f64: the same bits), as the float32
    // backward does: W is in L2 after the forward, W^T (as many bytes again)
    // streams from L3. Energy + forces, 2 threads, alternating processes, ms
    // hot / after a 64 MB sweep: 2iuz 3.31-3.42 / 4.27-4.51 against
    // 3.69-4.52 / 5.09-5.78, 3o99 5.74-6.02 / 6.55-6.73 against 6.83-7.62 /
    // 7.51-8.25. Larger groups read the stored W^T (stored_wt): an earlier
    // version that made W^T for every block of every group ran 1hz5 in
    // 152-158 ms against 102.
    if (l < static_cast<int64_t>(net.panel_bwd.size())) {
      const int64_t member = m * din * dout;
      net.with_panels(l, [&](auto w, auto wt) {  // float64 or float32 panels
        if (!net.stored_wt && small_gemm::panel_nt_f64_supported(din, dout)) {
          small_gemm::panel_nt_f64(rows, din, dout, g, dout, w + member, accumulate, deriv, din,
                                   out, din, chunks);
        } else {
          small_gemm::panel_gemm_f64(rows, din, dout, g, dout, wt + member, nullptr, accumulate,
                                     deriv, din, out, din, nullptr, chunks);
        }
      });
      return;
    }
  }
  // W_l is (d_in, d_out): its rows are the columns of W_l^T.
  small_gemm::gemm_nt<T>(rows, din, dout, g, dout, net.weight[l] + m * net.stride[l], net.ld[l],
                         out, din, deriv, din, accumulate);
}

template <typename T>
void run_task(const GroupNet<T>& net, const Task& task, int64_t member_begin, int64_t member_end,
              const T* aev, int64_t features, const int64_t* atoms, int64_t num_atoms,
              T* values, T* jac, bool input_grad, bool zero_blocks_exact, std::vector<T>& scratch,
              std::vector<uint64_t>& chunk_bits) {
  const int64_t rows = task.rows, in_dim = net.in_dim(), layers = net.layers();
  const int64_t last = layers - 1;
  int64_t widest = 0, hidden = 0;
  for (int64_t l = 1; l <= layers; ++l) {
    widest = std::max(widest, net.dims[l]);
    hidden += net.dims[l];
  }
  scratch.resize(static_cast<size_t>(rows * (in_dim + 2 * hidden + 2 * widest)));
  T* x = scratch.data();
  T* act = x + rows * in_dim;    // per layer: pre-activation, then activation (rows, d_l)
  T* der = act + rows * hidden;  // per hidden layer: CELU derivative (rows, d_l)
  T* g = der + rows * hidden;    // two gradient buffers (rows, widest)
  T* spare = g + rows * widest;
  std::vector<T*> a(layers), d(layers);
  for (int64_t l = 0, off = 0; l < layers; off += rows * net.dims[l + 1], ++l) {
    a[l] = act + off;
    d[l] = der + off;
  }
  // Gather the task's rows once for all its members (a run of columns at a time).
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = aev + atoms[net.rows_begin + task.row0 + r] * features;
    T* dst = x + r * in_dim;
    for (const auto& run : net.runs) std::memcpy(dst + run[1], src + run[0], run[2] * sizeof(T));
  }
  // With the panels, layer 1's forward skips the 16-column chunks of the AEV
  // that are zero in every row of a tile (most atoms lack neighbour pairs of
  // some kinds; group_atoms puts atoms that lack the same ones side by side):
  // they would add exact zeros. Its backward (J) skips them only when the
  // caller vouches that their derivative is 0 too (zero_blocks_exact): with
  // TorchANI's float32 cosine cutoff an entry is exactly 0 over the last ~4e-4
  // A below the cutoff while its slope is not, and J multiplies that slope.
  const uint64_t* chunks = nullptr;
  if (!net.panel_fwd.empty() && in_dim % 16 == 0 && in_dim <= 16 * 64) {
    chunk_bits.resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
      chunk_bits[r] = nonzero_chunks(x + r * in_dim, every_chunk(), in_dim / 16);
    chunks = chunk_bits.data();
  }
  T* jac_rows = input_grad ? jac + net.jac_offset + task.row0 * in_dim : nullptr;
  for (int64_t m = member_begin; m < member_end; ++m) {
    const T* h = x;
    for (int64_t l = 0; l < layers; ++l) {
      layer_forward(net, l, m, rows, h, a[l], l == 0 ? chunks : nullptr, l < last ? d[l] : nullptr,
                    m + 1 < member_end ? m + 1 : -1);
      h = a[l];
    }
    T* out = values + m * num_atoms;
    const int64_t* task_atoms = atoms + net.rows_begin + task.row0;
    for (int64_t r = 0; r < rows; ++r) out[task_atoms[r]] = h[r];
    if (!input_grad) continue;
    const bool accumulate = m != member_begin;  // J of this slice of members
    const T* w_last = net.weight[last] + m * net.stride[last];  // (d_last, 1)
    if (last == 0) {  // a single linear layer: J = W^T
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < in_dim; ++c) {
          T& j = jac_rows[r * in_dim + c];
          j = (accumulate ? j : T(0)) + w_last[c * net.ld[0]];
        }
      continue;
    }
    // d out / d (input of the last layer), then back through the hidden layers.
    int64_t width = net.dims[last];
    for (int64_t r = 0; r < rows; ++r) {
      const T* dr = d[last - 1] + r * width;
      for (int64_t c = 0; c < width; ++c) g[r * width + c] = w_last[c * net.ld[last]] * dr[c];
    }
    T* gl = g;
    T* gs = spare;
    for (int64_t l = last - 1; l >= 1; --l) {
      layer_backward(net, l, m, rows, gl, d[l - 1], false, gs, nullptr);
      std::swap(gl, gs);
    }
    layer_backward(net, 0, m, rows, gl, static_cast<const T*>(nullptr), accumulate, jac_rows,
                   zero_blocks_exact ? chunks : nullptr);
  }
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> ensemble_mlp_impl(
    const at::Tensor& aev, const at::Tensor& atoms, at::IntArrayRef sizes,
    at::TensorList columns, at::TensorList first, at::TensorList packs, at::TensorList panels,
    at::IntArrayRef layers, int64_t members, bool input_grad, bool zero_blocks_exact,
    int64_t activation) {
  const int64_t groups = static_cast<int64_t>(sizes.size());
  const int64_t features = aev.size(1);
  // Panels are used when given, on CPUs that run panel_gemm (AVX2); their
  // count is checked whenever they are given (also where they go unused).
  const bool use_panels = !panels.empty() && small_gemm::panels_supported();
  int64_t panel = 0;
  if (!panels.empty()) {
    int64_t expected = 0;
    for (int64_t nl : layers) expected += 2 * (nl - 1);
    TORCH_CHECK(static_cast<int64_t>(panels.size()) == expected, "ensemble_mlp: panels holds ",
                panels.size(), " tensors, expected 2 per hidden layer (", expected, ")");
  }
  std::vector<GroupNet<T>> nets(groups);
  int64_t rows_begin = 0, jac_size = 0, pack = 0, blocks = 0;
  for (int64_t g = 0; g < groups; ++g) {
    GroupNet<T>& net = nets[g];
    const at::Tensor& cols = columns[g];
    const at::Tensor& w1 = first[g];
    const int64_t nl = layers[g];
    TORCH_CHECK(sizes[g] >= 0, "ensemble_mlp: sizes[", g, "] = ", sizes[g], " is negative");
    TORCH_CHECK(cols.dim() == 1 && cols.scalar_type() == at::kLong && cols.is_contiguous(),
                "ensemble_mlp: columns[", g, "] must be a contiguous 1-D int64 tensor");
    TORCH_CHECK(nl >= 1, "ensemble_mlp: layers[", g, "] = ", nl, " must be >= 1");
    const int64_t k_cols = cols.size(0);
    TORCH_CHECK(in_range(cols, features), "ensemble_mlp: columns[", g, "] must be in [0, ",
                features, ")");
    TORCH_CHECK(w1.dim() == 2 && w1.size(0) == k_cols && w1.size(1) % members == 0 &&
                    w1.scalar_type() == aev.scalar_type() && w1.is_contiguous(),
                "ensemble_mlp: first[", g, "] must be a contiguous (", k_cols,
                ", members * width) tensor of the AEV's dtype, got ", w1.sizes());
    TORCH_CHECK(pack + 2 * nl - 1 <= static_cast<int64_t>(packs.size()),
                "ensemble_mlp: packs holds too few tensors for layers ", layers);
    net.rows_begin = rows_begin;
    net.rows = sizes[g];
    net.act = activation;
    net.jac_offset = jac_size;
    const int64_t* col = cols.data_ptr<int64_t>();
    for (int64_t c = 0; c < k_cols; ++c) {
      if (c > 0 && col[c] == col[c - 1] + 1) {
        ++net.runs.back()[2];
      } else {
        net.runs.push_back({col[c], c, 1});
      }
    }
    const int64_t d1 = w1.size(1) / members;
    net.dims = {k_cols, d1};
    net.weight = {w1.data_ptr<T>()};
    net.ld = {members * d1};
    net.stride = {d1};
    const at::Tensor& b1 = packs[pack];
    TORCH_CHECK(b1.numel() == members * d1 && b1.is_contiguous() &&
                    b1.scalar_type() == aev.scalar_type(),
                "ensemble_mlp: packs[", pack, "] must be the (members * ", d1, ",) layer-1 bias");
    net.bias = {b1.data_ptr<T>()};
    for (int64_t l = 1; l < nl; ++l) {
      const at::Tensor& w = packs[pack + 2 * l - 1];
      const at::Tensor& b = packs[pack + 2 * l];
      const int64_t din = net.dims.back();
      TORCH_CHECK(w.dim() == 3 && w.size(0) == members && w.size(1) == din && w.is_contiguous() &&
                      w.scalar_type() == aev.scalar_type(),
                  "ensemble_mlp: packs[", pack + 2 * l - 1, "] must be contiguous (", members,
                  ", ", din, ", width), got ", w.sizes());
      const int64_t dout = w.size(2);
      TORCH_CHECK(b.numel() == members * dout && b.is_contiguous() &&
                      b.scalar_type() == aev.scalar_type(),
                  "ensemble_mlp: packs[", pack + 2 * l, "] must hold ", members * dout, " biases");
      net.dims.push_back(dout);
      net.weight.push_back(w.data_ptr<T>());
      net.ld.push_back(dout);
      net.stride.push_back(din * dout);
      net.bias.push_back(b.data_ptr<T>());
    }
    TORCH_CHECK(net.dims.back() == 1, "ensemble_mlp: the last layer of group ", g,
                " has ", net.dims.back(), " outputs, expected 1");
    if (use_panels) {
      for (int64_t l = 0; l + 1 < nl; ++l) {
        const int64_t din = net.dims[l], dout = net.dims[l + 1];
        const at::Tensor& fwd = panels[panel];
        const at::Tensor& bwd = panels[panel + 1];
        // float32 panels of a float64 network: its weights' values (packing.py checks).
        const bool narrow = std::is_same_v<T, double> && fwd.scalar_type() == at::kFloat &&
                            bwd.scalar_type() == at::kFloat;
        TORCH_CHECK(din % 16 == 0 && dout % 16 == 0 && fwd.is_contiguous() &&
                        fwd.sizes() == at::IntArrayRef({members, dout / 16, din, 16}) &&
                        bwd.is_contiguous() &&
                        bwd.sizes() == at::IntArrayRef({members, din / 16, dout, 16}) &&
                        (narrow || (fwd.scalar_type() == aev.scalar_type() &&
                                    bwd.scalar_type() == aev.scalar_type())),
                    "ensemble_mlp: panels[", panel, "], panels[", panel + 1,
                    "] must be of the AEV's dtype (", aev.scalar_type(),
                    "; float32 also for a float64 AEV), (", members, ", ", dout / 16, ", ", din,
                    ", 16) and (", members, ", ", din / 16, ", ", dout, ", 16), got ",
                    fwd.scalar_type(), " ", fwd.sizes(), " and ", bwd.scalar_type(), " ",
                    bwd.sizes());
        net.panel_fwd.push_back(narrow ? nullptr : fwd.data_ptr<T>());
        net.panel_bwd.push_back(narrow ? nullptr : bwd.data_ptr<T>());
        net.narrow_fwd.push_back(narrow ? fwd.data_ptr<float>() : nullptr);
        net.narrow_bwd.push_back(narrow ? bwd.data_ptr<float>() : nullptr);
        panel += 2;
      }
    }
    pack += 2 * nl - 1;
    rows_begin += sizes[g];
    jac_size += sizes[g] * k_cols;
    net.blocks = (sizes[g] + kBlockRows - 1) / kBlockRows;
    blocks += net.blocks;
  }
  if (use_panels) {  // the groups whose backward reads the stored W^T (kStoredMinBlocks)
    auto panel_bytes = [&](const GroupNet<T>& net) {
      int64_t n = 0;
      for (int64_t l = 0; l < static_cast<int64_t>(net.panel_fwd.size()); ++l)
        n += net.dims[l] * net.dims[l + 1] *
             net.with_panels(l, [](auto w, auto) { return static_cast<int64_t>(sizeof(*w)); });
      return n * members;
    };
    int64_t bytes = 0;
    for (const auto& net : nets) bytes += panel_bytes(net);
    for (auto& net : nets) {
      // (float64: every group of many blocks, whatever the bytes, as before
      // panel_nt_f64 existed; see layer_backward.)
      const bool fits = sizeof(T) == sizeof(double) || bytes + panel_bytes(net) <= kStoredMaxBytes;
      if (net.blocks >= kStoredMinBlocks && fits) {
        net.stored_wt = true;
        bytes += panel_bytes(net);
      }
    }
  }
  TORCH_CHECK(rows_begin == atoms.numel(), "ensemble_mlp: sizes add up to ", rows_begin,
              " but atoms has ", atoms.numel(), " entries");
  const int64_t num_atoms = aev.size(0);
  TORCH_CHECK(distinct_in_range(atoms, num_atoms), "ensemble_mlp: atoms must be distinct rows of aev (in [0, ",
              num_atoms, "))");
  // Each atom's values land in its own column; atoms not in any group get 0.
  at::Tensor values = at::zeros({members, num_atoms}, aev.options());
  // Few blocks: split the members into slices too (p-major task order, so a
  // thread gets whole slices of the members for every group); each slice
  // writes its own partial J, added in slice order. The split depends on the
  // input only, so results are the same for any number of threads.
  const int64_t slices =
      std::min(members, std::max<int64_t>(1, (kTargetTasks + blocks - 1) / blocks));
  at::Tensor jac = at::empty({input_grad ? slices * jac_size : 0}, aev.options());
  std::vector<Task> tasks;
  for (int64_t p = 0; p < slices; ++p)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t b = 0, nb = (sizes[g] + kBlockRows - 1) / kBlockRows; b < nb; ++b) {
        const int64_t r0 = sizes[g] * b / nb, r1 = sizes[g] * (b + 1) / nb;  // even blocks
        tasks.push_back({g, r0, r1 - r0, p});
      }
  // Threads take the tasks one at a time, largest first: a static split of
  // the task list gave one thread 57% of the 3000-water grid's work (its H
  // blocks cost 1.5x the O blocks). Tasks write disjoint outputs, so the
  // results do not depend on which thread runs which task.
  std::vector<double> cost(groups);
  for (int64_t g = 0; g < groups; ++g) {
    double macs = 0;
    for (size_t l = 0; l + 1 < nets[g].dims.size(); ++l)
      macs += static_cast<double>(nets[g].dims[l]) * nets[g].dims[l + 1];
    cost[g] = macs;
  }
  auto task_cost = [&](const Task& t) {
    const int64_t m = members * (t.slice + 1) / slices - members * t.slice / slices;
    return cost[t.group] * static_cast<double>(t.rows * m);
  };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const Task& a, const Task& b) { return task_cost(a) > task_cost(b); });
  const T* aev_ptr = aev.data_ptr<T>();
  const int64_t* atom_ptr = atoms.data_ptr<int64_t>();
  T* value_ptr = values.data_ptr<T>();
  T* jac_ptr = input_grad ? jac.data_ptr<T>() : nullptr;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  // BLAS (float64, and float32 without panels) runs inside the tasks, on one
  // thread each (OneThreadBlas); without MKL's per-thread setting, inside
  // OpenMP's own regions, where an OpenMP-threaded BLAS keeps to one thread.
  const bool own_pool = use_panels || small_gemm::OneThreadBlas::available();
  const auto run_tasks = own_pool ? torchani_fast::parallel_for : at_parallel_for;
  run_tasks(0, workers, 1, [&](int64_t, int64_t) {
    const simd::FlushDenormals flush(std::is_same_v<T, float>);
    const small_gemm::OneThreadBlas one_thread_blas;
    thread_local std::vector<T> scratch;
    thread_local std::vector<uint64_t> chunk_bits;
    for (int64_t t = next++; t < num_tasks; t = next++) {
      const Task& task = tasks[t];
      const int64_t m0 = members * task.slice / slices, m1 = members * (task.slice + 1) / slices;
      run_task<T>(nets[task.group], task, m0, m1, aev_ptr, features, atom_ptr, num_atoms,
                  value_ptr, input_grad ? jac_ptr + task.slice * jac_size : nullptr, input_grad,
                  zero_blocks_exact, scratch, chunk_bits);
    }
  });
  if (input_grad && slices > 1) {  // add the slices' partial J into the first, in slice order
    torchani_fast::parallel_for(0, jac_size, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t p = 1; p < slices; ++p) {
        const T* src = jac_ptr + p * jac_size;
        for (int64_t i = begin; i < end; ++i) jac_ptr[i] += src[i];
      }
    });
    jac = jac.narrow(0, 0, jac_size);
  }
  return {values, jac};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ensemble_mlp_cpu(
    const at::Tensor& aev, const at::Tensor& atoms, at::IntArrayRef sizes,
    at::TensorList columns, at::TensorList first, at::TensorList packs, at::TensorList panels,
    at::IntArrayRef layers, int64_t members, bool input_grad, bool zero_blocks_exact,
    int64_t activation) {
  TORCH_CHECK(activation == small_gemm::kCelu01 || activation == small_gemm::kGelu,
              "ensemble_mlp: activation = ", activation, " must be 0 (CELU(0.1)) or 1 (GELU)");
  TORCH_CHECK(aev.dim() == 2 && aev.is_contiguous(),
              "ensemble_mlp: aev must be a contiguous (atoms, features) tensor, got ", aev.sizes());
  TORCH_CHECK(aev.scalar_type() == at::kFloat || aev.scalar_type() == at::kDouble,
              "ensemble_mlp: aev must be float32 or float64, got ", aev.scalar_type());
  TORCH_CHECK(atoms.dim() == 1 && atoms.scalar_type() == at::kLong && atoms.is_contiguous(),
              "ensemble_mlp: atoms must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(members >= 1, "ensemble_mlp: members = ", members, " must be >= 1");
  TORCH_CHECK(columns.size() == sizes.size() && first.size() == sizes.size() &&
                  layers.size() == sizes.size(),
              "ensemble_mlp: sizes, columns, first and layers need one entry per group, got ",
              sizes.size(), ", ", columns.size(), ", ", first.size(), ", ", layers.size());
  if (aev.scalar_type() == at::kFloat) {
    return ensemble_mlp_impl<float>(aev, atoms, sizes, columns, first, packs, panels, layers, members,
                                    input_grad, zero_blocks_exact, activation);
  }
  return ensemble_mlp_impl<double>(aev, atoms, sizes, columns, first, packs, panels, layers, members,
                                   input_grad, zero_blocks_exact, activation);
}

at::Tensor ensemble_atomic_cpu(const at::Tensor& aev, const at::Tensor& atoms,
                               at::IntArrayRef sizes, at::TensorList columns,
                               at::TensorList first, at::TensorList packs,
                               at::TensorList panels, at::IntArrayRef layers, int64_t members,
                               bool zero_blocks_exact, int64_t activation) {
  return std::get<0>(ensemble_mlp_cpu(aev, atoms, sizes, columns, first, packs, panels, layers,
                                      members, false, zero_blocks_exact, activation));
}

void check_energies_args(const at::Tensor& aev, int64_t molecules, int64_t divisor) {
  TORCH_CHECK(aev.dim() == 2 && molecules >= 1 && aev.size(0) % molecules == 0,
              "ensemble_energies: molecules = ", molecules, " must be >= 1 and divide the ",
              aev.dim() == 2 ? aev.size(0) : -1, " rows of aev");
  TORCH_CHECK(divisor >= 1, "ensemble_energies: divisor = ", divisor, " must be >= 1");
}

at::Tensor energies_from_values(const at::Tensor& values, int64_t molecules, int64_t divisor) {
  // The ATen reductions FusedEnsemble._reduce runs, in its order (and so with
  // its bits): over each molecule's atoms per member, over the members, / divisor.
  return values.view({values.size(0), molecules, -1}).sum(2).sum(0).div(divisor);
}

at::Tensor ensemble_energies_cpu(const at::Tensor& aev, const at::Tensor& atoms,
                                 at::IntArrayRef sizes, at::TensorList columns,
                                 at::TensorList first, at::TensorList packs,
                                 at::TensorList panels, at::IntArrayRef layers, int64_t members,
                                 int64_t molecules, int64_t divisor, bool zero_blocks_exact,
                                 int64_t activation) {
  check_energies_args(aev, molecules, divisor);
  const at::Tensor values = std::get<0>(ensemble_mlp_cpu(aev, atoms, sizes, columns, first, packs,
                                                         panels, layers, members, false,
                                                         zero_blocks_exact, activation));
  return energies_from_values(values, molecules, divisor);
}

}  // namespace torchani_fast
