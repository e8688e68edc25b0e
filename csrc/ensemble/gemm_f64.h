// float64 matrix products of the fused networks (ensemble/ensemble_cpu.cpp), the
// counterparts of gemm.h's float32 panel kernels on the same 16-column panels
// (nn/packing.py packs both dtypes alike):
//
//   panel_gemm_f64(A, W) = A W (+ bias, or + C; then * D, or CELU / GELU)
//                                                  AVX2 + FMA (4 lanes) or AVX-512 (8)
//                          (the backward: the same on W^T's panels)
//   panel_nt_f64(G, W)   = G W^T from W's panels, transposed in L1 (AVX-512)
//   dot_rows_f64         = the last layer's one output column
//
// W's panels may also be float32 (weights that are float32 values): they are
// widened, exactly, as they are read (panel_gemm_f64's comment below).
//
// A BLAS dgemm on few rows (a block of atoms times one member's weights)
// packs the weight matrix again on every call and runs at a fraction of its
// large-matrix rate; the panels are packed once. Zero chunks (a_chunks,
// c_chunks: 16-column chunks per row, as in gemm.h) are skipped the same way.
//
// Every output is its bias (or C, or 0) plus the products over k in
// increasing order, one FMA each, in both instruction sets: AVX2 and AVX-512
// give the same bits (the activations too: simd_math_f64.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/simd_math_f64.h"
#include "ensemble/gemm.h"

namespace torchani_fast::small_gemm {

// GELU (exact erf form) and its derivative in PyTorch's float64 formulas
// (GeluKernel / GeluBackwardKernel, approximate="none").
inline double gelu_f64(double x, double& deriv) {
  constexpr double kAlphaG = M_SQRT1_2, kBeta = M_2_SQRTPI * M_SQRT1_2 * 0.5;
  const double cdf = 0.5 * (1.0 + std::erf(x * kAlphaG));
  deriv = cdf + x * (kBeta * std::exp(x * x * -0.5));
  return x * cdf;  // = x * 0.5 * (1 + erf): the halving is exact
}

// panel_nt_f64's widest n: one W^T panel of n x 16 doubles, 32 KB, in L1.
constexpr int64_t kNtSlabMaxNF64 = 256;

#ifdef TF_SIMD_AVX2
// GCC 12 warns that its own AVX-512 headers read an uninitialised value (GCC
// bug 105593, as in gemm.h).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// The activation of `count` values at v (in place), derivative into d.
TF_AVX2_INLINE __m256d activate_f64(__m256d v, __m256d& deriv) { return simd::celu01(v, deriv); }
TF_AVX512_INLINE __m512d activate_f64(__m512d v, __m512d& deriv) { return simd::celu01(v, deriv); }

// GELU lane by lane (std::erf: no float64 vector erf here), through memory.
inline void gelu_lanes_f64(double* v, double* d, int lanes) {
  for (int i = 0; i < lanes; ++i) v[i] = gelu_f64(v[i], d[i]);
}

// ---------------------------------------------------------------------------
// AVX2: tiles of up to 6 rows times 8 columns (half a panel, 2 vectors).
// ---------------------------------------------------------------------------

template <int R>
TF_AVX2_INLINE void half_panel_steps(__m256d (&acc)[R][2], const double* a, int64_t lda,
                                     const double* w, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * (p + 8)), _MM_HINT_T0);
    const __m256d w0 = _mm256_loadu_pd(w + 16 * p), w1 = _mm256_loadu_pd(w + 16 * p + 4);
    for (int r = 0; r < R; ++r) {
      const __m256d x = _mm256_broadcast_sd(a + r * lda + p);
      acc[r][0] = _mm256_fmadd_pd(x, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_pd(x, w1, acc[r][1]);
    }
  }
}

// Rows 0..R of C[:, 0:8] = epilogue(A W[:, 0:8]), `w` pointing at the 8
// columns in their (k, 16) panel; the epilogue of gemm.h's panel_rows.
template <int R>
TF_AVX2_INLINE void half_panel_rows(const double* a, int64_t lda, const double* w, int64_t k,
                                    uint64_t chunks, const double* bias, bool accumulate,
                                    const double* d, int64_t ldd, double* c, int64_t ldc,
                                    double* act_d, int64_t act) {
  __m256d acc[R][2];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      acc[r][h] = bias != nullptr ? _mm256_loadu_pd(bias + 4 * h)
                  : accumulate    ? _mm256_loadu_pd(c + r * ldc + 4 * h)
                                  : _mm256_setzero_pd();
    }
  }
  ChunkRuns runs(chunks, k);
  for (int64_t p0, p1; runs.next(p0, p1);) half_panel_steps<R>(acc, a, lda, w, p0, p1);
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m256d v = acc[r][h];
      if (d != nullptr) v = _mm256_mul_pd(v, _mm256_loadu_pd(d + r * ldd + 4 * h));
      if (act_d != nullptr && act == kCelu01) {
        __m256d deriv;
        v = activate_f64(v, deriv);
        _mm256_storeu_pd(act_d + r * ldc + 4 * h, deriv);
      }
      _mm256_storeu_pd(c + r * ldc + 4 * h, v);
    }
    if (act_d != nullptr && act != kCelu01) gelu_lanes_f64(c + r * ldc, act_d + r * ldc, 8);
  }
}

TF_AVX2 inline void panel_gemm_f64_avx2(int64_t m, int64_t n, int64_t k, const double* a,
                                        int64_t lda, const double* w, const double* bias,
                                        bool accumulate, const double* d, int64_t ldd, double* c,
                                        int64_t ldc, const uint64_t* a_chunks,
                                        const uint64_t* c_chunks, double* act_d, int64_t act) {
  for (int64_t j = 0; j < n; j += 8) {
    const double* wj = w + (j / 16) * 16 * k + j % 16;
    const double* bj = bias ? bias + j : nullptr;
    for (int64_t r = 0; r < m; r += 6) {
      const int64_t rows = std::min<int64_t>(6, m - r);
      double* cr = c + r * ldc + j;
      if (c_chunks != nullptr && ((chunks_of(c_chunks + r, rows) >> (j / 16)) & 1) == 0) {
        if (!accumulate)
          for (int64_t q = 0; q < rows; ++q) std::memset(cr + q * ldc, 0, 8 * sizeof(double));
        continue;
      }
      const uint64_t kc = a_chunks != nullptr ? chunks_of(a_chunks + r, rows) : kAllChunks;
      const double* ar = a + r * lda;
      const double* dr = d ? d + r * ldd + j : nullptr;
      double* er = act_d ? act_d + r * ldc + j : nullptr;
      switch (rows) {
        case 6: half_panel_rows<6>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 5: half_panel_rows<5>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 4: half_panel_rows<4>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 3: half_panel_rows<3>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 2: half_panel_rows<2>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        default: half_panel_rows<1>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// AVX-512: tiles of up to 6 rows times up to 2 panels (32 columns, 4 vectors
// per row: 24 accumulators), so that each broadcast of A feeds 4 FMAs and
// each line of W 6; with float32 panels, 12 rows times 1 panel (each widened
// line of W feeds 12 FMAs).
// ---------------------------------------------------------------------------

// The 8 weights at w as doubles (float32 panels widened: exact).
TF_AVX512_INLINE __m512d load8_f64(const double* w) { return _mm512_loadu_pd(w); }
TF_AVX512_INLINE __m512d load8_f64(const float* w) { return _mm512_cvtps_pd(_mm256_loadu_ps(w)); }

template <int R, int P, bool Stream, typename WT>
TF_AVX512_INLINE void panel_steps512_f64(__m512d (&acc)[R][2 * P], const double* a, int64_t lda,
                                         const WT* const (&w)[P], int64_t p0, int64_t p1,
                                         const char* stream) {
  for (int64_t p = p0; p < p1; ++p) {
    if (Stream) _mm_prefetch(stream + 64 * p, _MM_HINT_T1);
    __m512d wv[2 * P];
    for (int q = 0; q < P; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(w[q] + 16 * (p + 8)), _MM_HINT_T0);
      if constexpr (sizeof(WT) == 8)  // (a float32 panel's row is one line)
        _mm_prefetch(reinterpret_cast<const char*>(w[q] + 16 * (p + 8) + 8), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        wv[2 * q + h] = load8_f64(w[q] + 16 * p + 8 * h);
        asm("" : "+v"(wv[2 * q + h]));  // a register for its R products (gemm.h)
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512d x = _mm512_set1_pd(a[r * lda + p]);
      for (int v = 0; v < 2 * P; ++v) acc[r][v] = _mm512_fmadd_pd(x, wv[v], acc[r][v]);
    }
  }
}

template <int R, int P, typename WT>
TF_AVX512 void panel_tile512_f64(const double* a, int64_t lda, const WT* w, int64_t k,
                                 uint64_t chunks, const double* bias, bool accumulate,
                                 const double* d, int64_t ldd, double* c, int64_t ldc,
                                 double* act_d, const int64_t* cols, const char* stream,
                                 int64_t act) {
  const WT* wq[P];
  __m512d acc[R][2 * P];
  for (int q = 0; q < P; ++q) {
    wq[q] = w + cols[q] * k;
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        const int64_t col = cols[q] + 8 * h;
        acc[r][2 * q + h] = bias != nullptr ? _mm512_loadu_pd(bias + col)
                            : accumulate    ? _mm512_loadu_pd(c + r * ldc + col)
                                            : _mm512_setzero_pd();
      }
    }
  }
  ChunkRuns runs(chunks, k);
  for (int64_t p0, p1; runs.next(p0, p1);) {
    if (stream != nullptr)
      panel_steps512_f64<R, P, true, WT>(acc, a, lda, wq, p0, p1, stream);
    else
      panel_steps512_f64<R, P, false, WT>(acc, a, lda, wq, p0, p1, nullptr);
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) {
      for (int h = 0; h < 2; ++h) {
        const int64_t col = cols[q] + 8 * h;
        __m512d v = acc[r][2 * q + h];
        if (d != nullptr) v = _mm512_mul_pd(v, _mm512_loadu_pd(d + r * ldd + col));
        if (act_d != nullptr && act == kCelu01) {
          __m512d deriv;
          v = activate_f64(v, deriv);
          _mm512_storeu_pd(act_d + r * ldc + col, deriv);
        }
        _mm512_storeu_pd(c + r * ldc + col, v);
      }
      if (act_d != nullptr && act != kCelu01)
        gelu_lanes_f64(c + r * ldc + cols[q], act_d + r * ldc + cols[q], 16);
    }
  }
}

template <int R, typename WT>
TF_AVX512 void panel_tile512_f64(int panels, const double* a, int64_t lda, const WT* w,
                                 int64_t k, uint64_t chunks, const double* bias, bool accumulate,
                                 const double* d, int64_t ldd, double* c, int64_t ldc,
                                 double* act_d, const int64_t* cols, const char* stream,
                                 int64_t act) {
  if (panels == 2) {
    panel_tile512_f64<R, 2, WT>(a, lda, w, k, chunks, bias, accumulate, d, ldd, c, ldc, act_d, cols, stream, act);
  } else {
    panel_tile512_f64<R, 1, WT>(a, lda, w, k, chunks, bias, accumulate, d, ldd, c, ldc, act_d, cols, stream, act);
  }
}

template <typename WT>
TF_AVX512 void panel_gemm_f64_avx512(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda,
                                     const WT* w, const double* bias, bool accumulate,
                                     const double* d, int64_t ldd, double* c, int64_t ldc,
                                     const uint64_t* a_chunks, const uint64_t* c_chunks,
                                     double* act_d, const double* next, int64_t next_doubles,
                                     int64_t act) {
  constexpr bool kNarrow = std::is_same_v<WT, float>;
  constexpr int64_t kCols = kNarrow ? 16 : 32, kRows = kNarrow ? 12 : 6;
  for (int64_t j0 = 0; j0 < n; j0 += kCols) {
    const int64_t group_end = std::min<int64_t>(n, j0 + kCols);
    // As in gemm_panels.h: the group's tiles prefetch into L2, one line per
    // step of k, the next group's panels, or after the last group `next`.
    const char* stream = group_end < n ? reinterpret_cast<const char*>(w + group_end * k)
                                       : reinterpret_cast<const char*>(next);
    int64_t stream_left = group_end < n ? std::min<int64_t>(kCols, n - group_end) * k * int64_t(sizeof(WT))
                          : next != nullptr ? next_doubles * int64_t(sizeof(double)) : 0;
    for (int64_t r = 0; r < m; r += kRows) {
      const char* tile_stream = nullptr;
      if (stream_left > 0) {
        tile_stream = stream;
        stream += 64 * k;
        stream_left -= 64 * k;
      }
      const int64_t rows = std::min<int64_t>(kRows, m - r);
      double* cr = c + r * ldc;
      const uint64_t wanted = c_chunks != nullptr ? chunks_of(c_chunks + r, rows) : kAllChunks;
      int64_t cols[2];
      int panels = 0;
      for (int64_t j = j0; j < group_end; j += 16) {
        if ((wanted >> (j / 16)) & 1) {
          cols[panels++] = j;
        } else if (!accumulate) {
          for (int64_t q = 0; q < rows; ++q) std::memset(cr + q * ldc + j, 0, 16 * sizeof(double));
        }
      }
      if (panels == 0) continue;
      const uint64_t kc = a_chunks != nullptr ? chunks_of(a_chunks + r, rows) : kAllChunks;
      const double* ar = a + r * lda;
      const double* dr = d ? d + r * ldd : nullptr;
      double* er = act_d ? act_d + r * ldc : nullptr;
      if constexpr (kNarrow) {
        switch (rows) {
#define TF_NARROW_CASE(R) case R: panel_tile512_f64<R, 1, WT>(ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
          TF_NARROW_CASE(12) TF_NARROW_CASE(11) TF_NARROW_CASE(10) TF_NARROW_CASE(9) TF_NARROW_CASE(8) TF_NARROW_CASE(7)
          TF_NARROW_CASE(6) TF_NARROW_CASE(5) TF_NARROW_CASE(4) TF_NARROW_CASE(3) TF_NARROW_CASE(2)
          default: panel_tile512_f64<1, 1, WT>(ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
#undef TF_NARROW_CASE
        }
      } else {
        switch (rows) {
          case 6: panel_tile512_f64<6, WT>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
          case 5: panel_tile512_f64<5, WT>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
          case 4: panel_tile512_f64<4, WT>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
          case 3: panel_tile512_f64<3, WT>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
          case 2: panel_tile512_f64<2, WT>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
          default: panel_tile512_f64<1, WT>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
        }
      }
    }
  }
}

// dst[j * ldd + i] = src[i * lds + j] for an 8 x 8 block of doubles: pairs
// of rows interleaved, then 128-bit lanes gathered twice (24 shuffles).
template <typename WT>
TF_AVX512_INLINE void transpose8x8_f64(const WT* src, int64_t lds, double* dst, int64_t ldd) {
  __m512d r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = load8_f64(src + i * lds);  // (float32: widened)
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_pd(r[i], r[i + 1]);      // (r_i[0], r_i+1[0]), (r_i[2], r_i+1[2]), ...
    t[i + 1] = _mm512_unpackhi_pd(r[i], r[i + 1]);  // (r_i[1], r_i+1[1]), (r_i[3], r_i+1[3]), ...
  }
  for (int h = 0; h < 8; h += 4) {  // lanes 0, 2 (0x88) and 1, 3 (0xDD) of two pairs of rows
    r[h] = _mm512_shuffle_f64x2(t[h], t[h + 2], 0x88);
    r[h + 1] = _mm512_shuffle_f64x2(t[h + 1], t[h + 3], 0x88);
    r[h + 2] = _mm512_shuffle_f64x2(t[h], t[h + 2], 0xDD);
    r[h + 3] = _mm512_shuffle_f64x2(t[h + 1], t[h + 3], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {  // column j from r[j] and r[4 + j], column j + 4 likewise
    _mm512_storeu_pd(dst + j * ldd, _mm512_shuffle_f64x2(r[j], r[4 + j], 0x88));
    _mm512_storeu_pd(dst + (j + 4) * ldd, _mm512_shuffle_f64x2(r[j], r[4 + j], 0xDD));
  }
}

// dst[j * 16 + i] = src[i * 16 + j]: a contiguous 16 x 16 block transposed.
template <typename WT>
TF_AVX512_INLINE void transpose16x16_f64(const WT* src, double* dst) {
  for (int bi = 0; bi < 2; ++bi)
    for (int bj = 0; bj < 2; ++bj) transpose8x8_f64(src + 128 * bi + 8 * bj, 16, dst + 128 * bj + 8 * bi, 16);
}

// C (m x k) = G (m x n) W^T (times D, or added to C), W (k x n) given as its
// forward panels: each slab of 16 rows of W is transposed into one W^T panel
// (n, 16) in an L1 buffer, which panel_gemm_f64_avx512 multiplies as it does
// the stored W^T panels: the same operations in the same order, so the same
// bits, reading W (which the forward pass has just brought into L2) instead of
// as many bytes of W^T from L3 or memory. A slab no row of c_chunks wants is
// skipped (0, or C kept). k % 16 == 0, n % 16 == 0, n <= kNtSlabMaxNF64.
// W's panels may be float32 (a network whose weights are float32 values,
// panel_gemm_f64 below): the transposes widen them.
template <typename WT>
TF_AVX512 void panel_nt_f64_avx512(int64_t m, int64_t k, int64_t n, const double* g, int64_t ldg,
                                   const WT* w, bool accumulate, const double* d, int64_t ldd,
                                   double* c, int64_t ldc, const uint64_t* c_chunks) {
  alignas(64) double slab[kNtSlabMaxNF64 * 16];
  constexpr int64_t kRowsAtOnce = 96;  // rows per panel_gemm call (their shifted chunks below)
  uint64_t shifted[kRowsAtOnce];
  const uint64_t wanted_by_any = c_chunks != nullptr ? chunks_of(c_chunks, m) : kAllChunks;
  for (int64_t i0 = 0; i0 < k; i0 += 16) {
    if (((wanted_by_any >> (i0 / 16)) & 1) == 0) {
      if (!accumulate)
        for (int64_t r = 0; r < m; ++r) std::memset(c + r * ldc + i0, 0, 16 * sizeof(double));
      continue;
    }
    for (int64_t p = 0; p < n / 16; ++p) transpose16x16_f64(w + p * 16 * k + 16 * i0, slab + 256 * p);
    for (int64_t r0 = 0; r0 < m; r0 += kRowsAtOnce) {
      const int64_t rows = std::min<int64_t>(kRowsAtOnce, m - r0);
      if (c_chunks != nullptr)
        for (int64_t r = 0; r < rows; ++r) shifted[r] = c_chunks[r0 + r] >> (i0 / 16);
      panel_gemm_f64_avx512(rows, 16, n, g + r0 * ldg, ldg, slab, nullptr, accumulate,
                            d != nullptr ? d + r0 * ldd + i0 : nullptr, ldd, c + r0 * ldc + i0, ldc,
                            nullptr, c_chunks != nullptr ? shifted : nullptr, nullptr, nullptr, 0,
                            kCelu01);
    }
  }
}

// dst[i] = src[i] for i < count, count % 4 == 0 (panels of 16 columns).
TF_AVX2 inline void widen_avx2(const float* src, int64_t count, double* dst) {
  for (int64_t i = 0; i < count; i += 4) _mm256_storeu_pd(dst + i, _mm256_cvtps_pd(_mm_loadu_ps(src + i)));
}

// CELU(0.1) of count values in place, derivative into d; the tail scalar.
TF_AVX2 inline int64_t celu_f64_avx2(double* z, double* d, int64_t count) {
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    __m256d deriv;
    _mm256_storeu_pd(z + i, simd::celu01(_mm256_loadu_pd(z + i), deriv));
    _mm256_storeu_pd(d + i, deriv);
  }
  return i;
}
#pragma GCC diagnostic pop
#endif  // TF_SIMD_AVX2

// C (m x n) = epilogue(A W) as gemm.h's panel_gemm, float64, W as (k, 16)
// panels; n % 16 == 0; needs panels_supported(). act_d: C = act(A W + bias)
// with the derivative into act_d (not with c_chunks). next: next_doubles
// doubles read after this product, prefetched into L2 while its last group of
// panels runs (AVX-512; a hint, results do not depend on it).
//
// W's panels may be float32: a float64 network whose weights are all float32
// values (as the published ANI weights are) keeps its panels in float32
// (nn/packing.py's _narrowed). Widening is exact, so the same operations on
// the same values: the same bits as float64 panels, from half the bytes,
// which is what a call on a small molecule waits for (each member's weights
// stream from L3 for a few rows). With AVX-512 the tiles widen W as they load
// it, 12 rows x 16 columns (2 conversions per 24 FMAs: with 6 x 32 tiles' 4,
// the conversions' port slots made compute-bound calls 3-5% slower); with
// AVX2, each group of 32 columns is widened into a per-thread buffer first.
// Energy + forces, float64, 2 threads, alternating processes, ms, float64 ->
// float32 panels (AVX-512): 2iuz 3.97-4.67 -> 3.42-3.63, 3o99 7.52-8.35 ->
// 6.47-6.95, small 16.66-18.05 -> 15.75-17.54, 1hz5 55.1-57.6 -> 55.5-58.8,
// benzene 2.90-3.19 -> 3.05-3.10; capped at AVX2: 2iuz 9.54-10.23 ->
// 7.19-8.12, 3o99 15.91-16.13 -> 13.25-14.02, benzene 6.05-6.33 -> 5.13-5.59.
template <typename WT>  // double or float
inline void panel_gemm_f64(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda,
                           const WT* w, const double* bias, bool accumulate, const double* d,
                           int64_t ldd, double* c, int64_t ldc, const uint64_t* a_chunks = nullptr,
                           const uint64_t* c_chunks = nullptr, double* act_d = nullptr,
                           const double* next = nullptr, int64_t next_doubles = 0,
                           int64_t act = kCelu01) {
  TORCH_CHECK(act_d == nullptr || c_chunks == nullptr, "panel_gemm_f64: act_d with c_chunks");
#ifdef TF_SIMD_AVX2
  if (simd::have_avx512()) {
    panel_gemm_f64_avx512(m, n, k, a, lda, w, bias, accumulate, d, ldd, c, ldc, a_chunks, c_chunks,
                          act_d, next, next_doubles, act);
  } else if constexpr (std::is_same_v<WT, double>) {
    panel_gemm_f64_avx2(m, n, k, a, lda, w, bias, accumulate, d, ldd, c, ldc, a_chunks, c_chunks,
                        act_d, act);
  } else {
    constexpr int64_t kGroup = 32;
    thread_local std::vector<double> wide;
    thread_local std::vector<uint64_t> shifted;
    wide.resize(static_cast<size_t>(kGroup * k));
    if (c_chunks != nullptr) shifted.resize(static_cast<size_t>(m));
    for (int64_t j0 = 0; j0 < n; j0 += kGroup) {
      const int64_t cols = std::min(kGroup, n - j0);
      widen_avx2(w + j0 * k, cols * k, wide.data());
      if (c_chunks != nullptr)
        for (int64_t r = 0; r < m; ++r) shifted[r] = c_chunks[r] >> (j0 / 16);
      panel_gemm_f64_avx2(m, cols, k, a, lda, wide.data(), bias != nullptr ? bias + j0 : nullptr,
                          accumulate, d != nullptr ? d + j0 : nullptr, ldd, c + j0, ldc, a_chunks,
                          c_chunks != nullptr ? shifted.data() : nullptr,
                          act_d != nullptr ? act_d + j0 : nullptr, act);
    }
  }
#else
  TORCH_CHECK(false, "panel_gemm_f64 needs an x86-64 CPU with AVX2");
#endif
}

// Whether panel_nt_f64 runs here: AVX-512, k % 16 == 0, n % 16 == 0, n <= 256.
inline bool panel_nt_f64_supported(int64_t k, int64_t n) {
#ifdef TF_SIMD_AVX2
  return simd::have_avx512() && k % 16 == 0 && n % 16 == 0 && n > 0 && n <= kNtSlabMaxNF64;
#else
  (void)k, (void)n;
  return false;
#endif
}

// C (m x k) = G (m x n) W^T (times D, or added to C) from W's forward panels,
// the same bits as panel_gemm_f64 on the stored W^T panels; needs
// panel_nt_f64_supported(k, n). c_chunks: C's chunks wanted (per row, or nullptr).
// W's panels in float64, or in float32 (widened: the same bits).
template <typename WT>
inline void panel_nt_f64(int64_t m, int64_t k, int64_t n, const double* g, int64_t ldg,
                         const WT* w, bool accumulate, const double* d, int64_t ldd, double* c,
                         int64_t ldc, const uint64_t* c_chunks = nullptr) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(panel_nt_f64_supported(k, n));  // the caller's check
#ifdef TF_SIMD_AVX2
  panel_nt_f64_avx512(m, k, n, g, ldg, w, accumulate, d, ldd, c, ldc, c_chunks);
#endif
}

}  // namespace torchani_fast::small_gemm
