// Index checks and the zero-chunk scans shared by the networks op
// (ensemble/ensemble_cpu.cpp: which 16-column chunks of a row are not all zero) and the
// atom grouping (grouping_cpu.cpp: which AEV blocks an atom has).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/simd_math.h"

namespace torchani_fast {
namespace ensemble_detail {

// Every entry of a contiguous int64 tensor is in [0, end) (a plain loop: this
// runs on every call, where min()/max() would be two ATen ops each).
inline bool in_range(const at::Tensor& idx, int64_t end) {
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0, n = idx.numel(); i < n; ++i)
    if (p[i] < 0 || p[i] >= end) return false;
  return true;
}

// in_range, and no entry repeats (each atom's values are written once).
inline bool distinct_in_range(const at::Tensor& idx, int64_t end) {
  if (!in_range(idx, end)) return false;
  std::vector<char> seen(static_cast<size_t>(end), 0);
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0, n = idx.numel(); i < n; ++i) {
    if (seen[p[i]]) return false;
    seen[p[i]] = 1;
  }
  return true;
}

#ifdef TF_SIMD_AVX2
TF_AVX2 inline uint64_t nonzero_chunks_avx2(const float* row, const int64_t* starts, int64_t count) {
  const __m256 zero = _mm256_setzero_ps();
  uint64_t bits = 0;
  for (int64_t i = 0; i < count; ++i) {
    const float* p = row + starts[i];
    const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(p), zero, _CMP_NEQ_UQ);
    const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(p + 8), zero, _CMP_NEQ_UQ);
    bits |= uint64_t(_mm256_movemask_ps(_mm256_or_ps(a, b)) != 0) << (starts[i] / 16);
  }
  return bits;
}
#endif

// Whether any of p[0 .. n) is nonzero (NaN counts, as ne(0) does); no early
// exit, so that the loop vectorises.
template <typename T>
inline bool any_nonzero(const T* p, int64_t n) {
  int nonzero = 0;
  for (int64_t c = 0; c < n; ++c) nonzero |= p[c] != T(0);
  return nonzero != 0;
}

// Bit c / 16 for each chunk start c of `starts` (count of them, c < 1024):
// row[c .. c + 15] is not all zero (NaN counts).
template <typename T>
inline uint64_t nonzero_chunks(const T* row, const int64_t* starts, int64_t count) {
#ifdef TF_SIMD_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (simd::have_avx2()) return nonzero_chunks_avx2(row, starts, count);
  }
#endif
  uint64_t bits = 0;
  for (int64_t i = 0; i < count; ++i)
    bits |= uint64_t(any_nonzero(row + starts[i], 16)) << (starts[i] / 16);
  return bits;
}

// 0, 16, 32, ...: the chunks of a whole row.
inline const int64_t* every_chunk() {
  static const std::vector<int64_t> starts = [] {
    std::vector<int64_t> s(64);
    for (int64_t c = 0; c < 64; ++c) s[c] = 16 * c;
    return s;
  }();
  return starts.data();
}

}  // namespace ensemble_detail
}  // namespace torchani_fast
