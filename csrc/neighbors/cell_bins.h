// The per-atom and per-bin arithmetic of the neighbour search, written once for
// neighbors/neighbors_cpu.cpp and neighbors/neighbors_cuda.cu (see neighbors/neighbors_cpu.cpp for the
// algorithm). Plain C++ on raw pointers, so nvcc compiles it for the device.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace torchani_fast {
namespace neighbors {

struct Axis {
  int64_t nb;        // number of bins
  int64_t reach;     // search radius in bins
  double lo, width;  // fractional start and bin width
  int periodic;
};

// det(C) for the row-major 3x3 C.
TF_HOST_DEVICE inline double cell_determinant(const double* C) {
  return C[0] * (C[4] * C[8] - C[5] * C[7]) - C[1] * (C[3] * C[8] - C[5] * C[6]) +
         C[2] * (C[3] * C[7] - C[4] * C[6]);
}

// The one test of a usable cell, for every backend and for the input checks
// (validation.py words its error): det(C) finite and |det(C)| > 1e-8 times the
// product of the rows' lengths (scale-free: 1e-8 of a cube's volume).
TF_HOST_DEVICE inline bool singular_cell(const double* C, double det) {
  double scale = 1.0;
  for (int r = 0; r < 3; ++r)
    scale *= sqrt(C[3 * r] * C[3 * r] + C[3 * r + 1] * C[3 * r + 1] + C[3 * r + 2] * C[3 * r + 2]);
  const double size = fabs(det);  // NaN and inf fail one of the comparisons
  return !(size > 1e-8 * scale && size <= 1.7976931348623157e308);
}

// inv = C^-1 for the row-major 3x3 C (x = f @ C, f = x @ inv); returns det(C).
TF_HOST_DEVICE inline double invert_cell(const double* C, double* inv) {
  const double det = cell_determinant(C);
  inv[0] = (C[4] * C[8] - C[5] * C[7]) / det;
  inv[1] = (C[2] * C[7] - C[1] * C[8]) / det;
  inv[2] = (C[1] * C[5] - C[2] * C[4]) / det;
  inv[3] = (C[5] * C[6] - C[3] * C[8]) / det;
  inv[4] = (C[0] * C[8] - C[2] * C[6]) / det;
  inv[5] = (C[2] * C[3] - C[0] * C[5]) / det;
  inv[6] = (C[3] * C[7] - C[4] * C[6]) / det;
  inv[7] = (C[1] * C[6] - C[0] * C[7]) / det;
  inv[8] = (C[0] * C[4] - C[1] * C[3]) / det;
  return det;
}

// |delta f_a| <= cutoff * ||column a of inv|| for any pair closer than cutoff.
TF_HOST_DEVICE inline void fractional_spans(double cutoff, const double* inv, double* span) {
  for (int a = 0; a < 3; ++a)
    span[a] = cutoff * sqrt(inv[a] * inv[a] + inv[3 + a] * inv[3 + a] + inv[6 + a] * inv[6 + a]);
}

// Wraps the fractional coordinate f into [0, 1); returns the translation removed.
TF_HOST_DEVICE inline double wrap_unit(double& f) {
  double k = floor(f);
  f -= k;
  if (f >= 1.0) {  // f = -1e-17 gives 1 - 1e-17, which rounds to 1
    f = 0.0;
    k += 1.0;  // the shift must stay the translation actually removed
  }
  return k;
}

// Cartesian coordinates out = f @ C.
TF_HOST_DEVICE inline void to_cartesian(const double* f, const double* C, double* out) {
  for (int c = 0; c < 3; ++c) out[c] = f[0] * C[c] + f[1] * C[3 + c] + f[2] * C[6 + c];
}

// Halves the largest bin count until the grid has at most max_bins bins.
TF_HOST_DEVICE inline void limit_bins(double* nb, double max_bins) {
  while (nb[0] * nb[1] * nb[2] > max_bins) {
    int big = 0;
    for (int a = 1; a < 3; ++a)
      if (nb[a] > nb[big]) big = a;
    nb[big] = ceil(nb[big] / 2.0);
  }
}

// Limits of the search around one atom: at most kMaxReach bins (or periodic
// images) along one lattice vector and kMaxVisits bins in all, the product of
// (2 reach + 1) over the axes. Only a cell much smaller than the cutoff comes
// near them (a 0.2 A cube with a 5.2 A cutoff visits 55^3 = 166 375 images);
// beyond them the search would run for hours, so the ops refuse the cell.
constexpr double kMaxReach = 1e5;
constexpr double kMaxVisits = 1e6;

// The search grid of one molecule from its atoms' fractional extent [lo, hi]
// per axis (periodic axes span [0, 1)) and the cutoff's span in fractional
// units: per axis the bin count (at most max_bins bins in all: a few per
// atom), start, width and reach in bins. Returns the bins (or periodic
// images) the search around an atom visits, the product of (2 reach + 1);
// *thin_axis is the first axis whose reach exceeds kMaxReach (its reach is
// stored as 0 and given in *thin_reach), or -1. Shared by the CPU search and
// the CUDA setup kernel.
template <typename Flag>
TF_HOST_DEVICE inline double setup_axes(Axis* axis, const double* lo, const double* hi,
                                        const Flag* periodic, const double* span, bool cell_list,
                                        double max_bins, int* thin_axis, double* thin_reach) {
  double nb[3];
  for (int a = 0; a < 3; ++a) {
    Axis& ax = axis[a];
    ax.periodic = periodic[a] ? 1 : 0;
    const double extent = ax.periodic ? 1.0 : hi[a] - lo[a];
    ax.lo = ax.periodic ? 0.0 : lo[a];
    nb[a] = cell_list ? fmax(1.0, fmin(floor(extent / span[a]), max_bins)) : 1.0;
    if (!(nb[a] >= 1.0)) nb[a] = 1.0;  // NaN
  }
  limit_bins(nb, max_bins);
  *thin_axis = -1;
  double visits = 1;
  for (int a = 0; a < 3; ++a) {
    Axis& ax = axis[a];
    ax.nb = static_cast<int64_t>(nb[a]);
    const double extent = ax.periodic ? 1.0 : hi[a] - lo[a];
    // A flat molecule (extent ~1e-150) must not turn into a huge bin count:
    // decide in double, cast once the value is known to be small.
    ax.width = extent > 0 ? fmax(extent / ax.nb, span[a] * 1e-6) : 1.0;
    double reach = floor(span[a] / ax.width) + 1;
    if (!ax.periodic) reach = fmin(reach, static_cast<double>(ax.nb - 1));
    const bool thin = !(reach <= kMaxReach);
    if (thin && *thin_axis < 0) {
      *thin_axis = a;
      *thin_reach = reach;
    }
    ax.reach = thin ? 0 : static_cast<int64_t>(reach);
    visits *= 2 * reach + 1;
  }
  return visits;
}

// The (3-D) bin coordinates own[] of the flat bin index b.
TF_HOST_DEVICE inline void split_bin(int64_t b, const Axis* axis, int64_t* own) {
  for (int a = 2; a >= 0; --a) {
    own[a] = b % axis[a].nb;
    b /= axis[a].nb;
  }
}

// The bin at offset d[] from own[]: its flat index and the periodic image img[]
// it lies in. False when it falls outside a non-periodic axis.
TF_HOST_DEVICE inline bool offset_bin(const Axis* axis, const int64_t* own, const int64_t* d,
                                      int64_t& bin, int64_t* img) {
  bin = 0;
  bool valid = true;
  for (int a = 0; a < 3 && valid; ++a) {
    const Axis& ax = axis[a];
    const int64_t v = own[a] + d[a];
    if (ax.periodic) {
      const int64_t w = ((v % ax.nb) + ax.nb) % ax.nb;
      img[a] = (v - w) / ax.nb;
      bin = bin * ax.nb + w;
    } else {
      valid = v >= 0 && v < ax.nb;
      img[a] = 0;
      bin = bin * ax.nb + v;
    }
  }
  return valid;
}

// Whether atom i owns its pair with atom j in image img (each unordered pair
// once): j > i, or j == i with a "positive" image.
TF_HOST_DEVICE inline bool owns_pair(int64_t i, int64_t j, const int64_t* img) {
  const bool zero_img = img[0] == 0 && img[1] == 0 && img[2] == 0;
  const bool positive_img =
      img[0] > 0 || (img[0] == 0 && (img[1] > 0 || (img[1] == 0 && img[2] > 0)));
  return !(j < i || (j == i && (zero_img || !positive_img)));
}

// The lattice translation t = img @ C.
TF_HOST_DEVICE inline void image_translation(const int64_t* img, const double* C, double* t) {
  for (int c = 0; c < 3; ++c) t[c] = img[0] * C[c] + img[1] * C[3 + c] + img[2] * C[6 + c];
}

}  // namespace neighbors
}  // namespace torchani_fast
