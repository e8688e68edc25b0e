// The SIMD kernels behind ensemble/gemm.h's panel_gemm and panel_nt (float32:
// AVX2 + FMA tiles of 6 rows x 16 columns, AVX-512 tiles of up to 4 panels;
// the transposes and dot products of panel_nt; float64 dot products). Included
// by gemm.h, whose header comment gives the products and the zero-chunk
// conventions.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/simd_math.h"

namespace torchani_fast::small_gemm {

// The networks' activation between layers (the ensemble ops' `activation`):
// CELU(0.1) (TorchANI's TightCELU) or GELU in its exact erf form (torch.nn.GELU()).
enum Activation : int64_t { kCelu01 = 0, kGelu = 1 };

#ifdef TF_SIMD_AVX2
constexpr uint64_t kAllChunks = ~uint64_t(0);

// The activation `act` of v, lane by lane, its derivative into deriv.
TF_AVX2_INLINE __m256 activate(__m256 v, __m256& deriv, int64_t act) {
  return act == kGelu ? simd::gelu(v, deriv) : simd::celu01(v, deriv);
}
TF_AVX512_INLINE __m512 activate(__m512 v, __m512& deriv, int64_t act) {
  return act == kGelu ? simd::gelu(v, deriv) : simd::celu01(v, deriv);
}

// The OR of rows[0 .. count) (all chunks without rows).
inline uint64_t chunks_of(const uint64_t* rows, int64_t count) {
  if (rows == nullptr) return kAllChunks;
  uint64_t bits = 0;
  for (int64_t r = 0; r < count; ++r) bits |= rows[r];
  return bits;
}

// The runs of consecutive chunks set in `chunks`, [p0, p1) in columns and in
// increasing order; all of k in one run when every whole chunk of k is set
// (kAllChunks, for one). A tile skips zero chunks one run at a time: GCC
// stores the accumulators to the stack and reloads them around each pass of
// the step loop, once per chunk before (AVX-512, one core, 96 x 384 x 256
// with 3 of 24 chunks zero: 156 -> 164 GFLOP/s; none zero: 177). The sums
// keep their order, so the same bits.
class ChunkRuns {
 public:
  ChunkRuns(uint64_t chunks, int64_t k) {
    const uint64_t all_of_k = k >= 16 * 64 ? kAllChunks : (uint64_t(1) << (k / 16)) - 1;
    whole_ = (chunks & all_of_k) == all_of_k ? k : -1;
    left_ = whole_ >= 0 ? 0 : chunks;  // then never all ones: see next()
  }
  bool next(int64_t& p0, int64_t& p1) {
    if (whole_ >= 0) {
      p0 = 0;
      p1 = whole_;
      whole_ = -1;
      return true;
    }
    if (left_ == 0) return false;
    const int first = __builtin_ctzll(left_);
    const int length = __builtin_ctzll(~(left_ >> first));  // (a bit of ~ is set: left_ != ~0)
    p0 = 16 * int64_t(first);
    p1 = 16 * int64_t(first + length);
    left_ = first + length >= 64 ? 0 : left_ & (~uint64_t(0) << (first + length));
    return true;
  }

 private:
  int64_t whole_;   // k while all of k is still to come, else -1
  uint64_t left_;   // the chunks of the runs still to come
};

// acc[r] += A[r, p0:p1] W[p0:p1, 0:16] for rows r < R.
template <int R>
TF_AVX2_INLINE void panel_steps(__m256 (&acc)[R][2], const float* a, int64_t lda, const float* w,
                                int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    // The panel's line 16 rows ahead (prefetching past its end is harmless):
    // 5-10% on small molecules, whose weights come from L3 or memory.
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * (p + 16)), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + 16 * p), w1 = _mm256_loadu_ps(w + 16 * p + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + p);
      acc[r][0] = _mm256_fmadd_ps(x, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, w1, acc[r][1]);
    }
  }
}

// Rows 0..R of C[:, 0:16] = epilogue(A W), W one (k, 16) panel, contiguous,
// over A's chunks in `chunks` (kAllChunks: all of k).
// Accumulators start at `bias` (16 values) if given, else at C (accumulate) or 0;
// the result is multiplied by D (ldd) if given, and goes through the activation
// `act` if celu_d is given, which receives the derivative (row stride ldc).
template <int R>
TF_AVX2_INLINE void panel_rows(
    const float* a, int64_t lda, const float* w, int64_t k, uint64_t chunks, const float* bias,
    bool accumulate, const float* d, int64_t ldd, float* c, int64_t ldc, float* celu_d,
    int64_t act) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    if (bias != nullptr) {
      acc[r][0] = _mm256_loadu_ps(bias);
      acc[r][1] = _mm256_loadu_ps(bias + 8);
    } else if (accumulate) {
      acc[r][0] = _mm256_loadu_ps(c + r * ldc);
      acc[r][1] = _mm256_loadu_ps(c + r * ldc + 8);
    } else {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
  }
  ChunkRuns runs(chunks, k);
  for (int64_t p0, p1; runs.next(p0, p1);) panel_steps<R>(acc, a, lda, w, p0, p1);
  for (int r = 0; r < R; ++r) {
    if (d != nullptr) {
      acc[r][0] = _mm256_mul_ps(acc[r][0], _mm256_loadu_ps(d + r * ldd));
      acc[r][1] = _mm256_mul_ps(acc[r][1], _mm256_loadu_ps(d + r * ldd + 8));
    }
    if (celu_d != nullptr) {
      for (int h = 0; h < 2; ++h) {
        __m256 deriv;
        acc[r][h] = activate(acc[r][h], deriv, act);
        _mm256_storeu_ps(celu_d + r * ldc + 8 * h, deriv);
      }
    }
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

// C (m x n) = epilogue(A (m x k) W), W (k x n) stored as n/16 panels of (k, 16),
// each contiguous: a panel streams from memory once and stays in L1 over the rows.
// Tiles of 6 rows skip the chunks of a_chunks and c_chunks (per row, or
// nullptr) that none of their rows has.
TF_AVX2 inline void panel_gemm_avx2(
    int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* w,
    const float* bias, bool accumulate, const float* d, int64_t ldd, float* c, int64_t ldc,
    const uint64_t* a_chunks, const uint64_t* c_chunks, float* celu_d, int64_t act) {
  for (int64_t j = 0; j < n; j += 16) {
    const float* wj = w + j * k;
    const float* bj = bias ? bias + j : nullptr;
    for (int64_t r = 0; r < m; r += 6) {
      const int64_t rows = std::min<int64_t>(6, m - r);
      float* cr = c + r * ldc + j;
      if (c_chunks != nullptr && ((chunks_of(c_chunks + r, rows) >> (j / 16)) & 1) == 0) {
        if (!accumulate)
          for (int64_t q = 0; q < rows; ++q) std::memset(cr + q * ldc, 0, 16 * sizeof(float));
        continue;
      }
      const uint64_t kc = a_chunks != nullptr ? chunks_of(a_chunks + r, rows) : kAllChunks;
      const float* ar = a + r * lda;
      const float* dr = d ? d + r * ldd + j : nullptr;
      float* er = celu_d ? celu_d + r * ldc + j : nullptr;
      switch (rows) {
        case 6: panel_rows<6>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 5: panel_rows<5>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 4: panel_rows<4>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 3: panel_rows<3>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        case 2: panel_rows<2>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
        default: panel_rows<1>(ar, lda, wj, k, kc, bj, accumulate, dr, ldd, cr, ldc, er, act); break;
      }
    }
  }
}

// AVX-512: a tile of up to 6 rows takes up to 4 panels at once (64 columns in
// 24 accumulators), so that each broadcast of A feeds 4 FMAs and each panel
// line 6. Every product is summed over k in the same order as in the AVX2
// kernel, so the two give the same bits.
template <int R, int P, bool Stream>
TF_AVX512_INLINE void panel_steps512(__m512 (&acc)[R][P], const float* a, int64_t lda,
                                     const float* const (&w)[P], int64_t p0, int64_t p1,
                                     const char* stream) {
  for (int64_t p = p0; p < p1; ++p) {
    if (Stream) _mm_prefetch(stream + 64 * p, _MM_HINT_T1);
    __m512 wv[P];
    for (int q = 0; q < P; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(w[q] + 16 * (p + 16)), _MM_HINT_T0);
      wv[q] = _mm512_loadu_ps(w[q] + 16 * p);
      asm("" : "+v"(wv[q]));  // a register for its R products (see nt_tile512)
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + p]);
      for (int q = 0; q < P; ++q) acc[r][q] = _mm512_fmadd_ps(x, wv[q], acc[r][q]);
    }
  }
}

// Rows 0..R of C[:, cols[q] .. cols[q] + 16] for the P panels q, as panel_rows.
template <int R, int P>
TF_AVX512 void panel_tile512(const float* a, int64_t lda, const float* w, int64_t k,
                             uint64_t chunks, const float* bias, bool accumulate, const float* d,
                             int64_t ldd, float* c, int64_t ldc, float* celu_d, const int64_t* cols,
                             const char* stream, int64_t act) {
  const float* wq[P];
  __m512 acc[R][P];
  for (int q = 0; q < P; ++q) {
    wq[q] = w + cols[q] * k;
    for (int r = 0; r < R; ++r) {
      acc[r][q] = bias != nullptr ? _mm512_loadu_ps(bias + cols[q])
                  : accumulate    ? _mm512_loadu_ps(c + r * ldc + cols[q])
                                  : _mm512_setzero_ps();
    }
  }
  ChunkRuns runs(chunks, k);
  for (int64_t p0, p1; runs.next(p0, p1);) {
    if (stream != nullptr)
      panel_steps512<R, P, true>(acc, a, lda, wq, p0, p1, stream);
    else
      panel_steps512<R, P, false>(acc, a, lda, wq, p0, p1, nullptr);
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) {
      __m512 v = acc[r][q];
      if (d != nullptr) v = _mm512_mul_ps(v, _mm512_loadu_ps(d + r * ldd + cols[q]));
      if (celu_d != nullptr) {
        __m512 deriv;
        v = activate(v, deriv, act);
        _mm512_storeu_ps(celu_d + r * ldc + cols[q], deriv);
      }
      _mm512_storeu_ps(c + r * ldc + cols[q], v);
    }
  }
}

template <int R>
TF_AVX512 void panel_tile512(int panels, const float* a, int64_t lda, const float* w, int64_t k,
                             uint64_t chunks, const float* bias, bool accumulate, const float* d,
                             int64_t ldd, float* c, int64_t ldc, float* celu_d, const int64_t* cols,
                             const char* stream, int64_t act) {
  switch (panels) {
    case 4: panel_tile512<R, 4>(a, lda, w, k, chunks, bias, accumulate, d, ldd, c, ldc, celu_d, cols, stream, act); break;
    case 3: panel_tile512<R, 3>(a, lda, w, k, chunks, bias, accumulate, d, ldd, c, ldc, celu_d, cols, stream, act); break;
    case 2: panel_tile512<R, 2>(a, lda, w, k, chunks, bias, accumulate, d, ldd, c, ldc, celu_d, cols, stream, act); break;
    default: panel_tile512<R, 1>(a, lda, w, k, chunks, bias, accumulate, d, ldd, c, ldc, celu_d, cols, stream, act); break;
  }
}

// panel_gemm_avx2 with AVX-512: groups of 4 panels (the last group may hold
// fewer), each tile of 6 rows multiplying the panels of the group that
// c_chunks wants for it, over the chunks of k that a_chunks has.
TF_AVX512 inline void panel_gemm_avx512(
    int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* w,
    const float* bias, bool accumulate, const float* d, int64_t ldd, float* c, int64_t ldc,
    const uint64_t* a_chunks, const uint64_t* c_chunks, float* celu_d,
    const float* next = nullptr, int64_t next_floats = 0, int64_t act = kCelu01) {
  for (int64_t j0 = 0; j0 < n; j0 += 64) {
    const int64_t group_end = std::min<int64_t>(n, j0 + 64);
    // The group's tiles prefetch into L2, one line per step of k, the next
    // group's panels, or after the last group `next` (next_floats of them).
    const char* stream = reinterpret_cast<const char*>(group_end < n ? w + group_end * k : next);
    int64_t stream_left = group_end < n ? std::min<int64_t>(64, n - group_end) * k * 4
                          : next != nullptr ? next_floats * 4 : 0;
    for (int64_t r = 0; r < m; r += 6) {
      const char* tile_stream = nullptr;
      if (stream_left > 0) {
        tile_stream = stream;
        stream += 64 * k;
        stream_left -= 64 * k;
      }
      const int64_t rows = std::min<int64_t>(6, m - r);
      float* cr = c + r * ldc;
      const uint64_t wanted = c_chunks != nullptr ? chunks_of(c_chunks + r, rows) : kAllChunks;
      int64_t cols[4];
      int panels = 0;
      for (int64_t j = j0; j < group_end; j += 16) {
        if ((wanted >> (j / 16)) & 1) {
          cols[panels++] = j;
        } else if (!accumulate) {
          for (int64_t q = 0; q < rows; ++q) std::memset(cr + q * ldc + j, 0, 16 * sizeof(float));
        }
      }
      if (panels == 0) continue;
      const uint64_t kc = a_chunks != nullptr ? chunks_of(a_chunks + r, rows) : kAllChunks;
      const float* ar = a + r * lda;
      const float* dr = d ? d + r * ldd : nullptr;
      float* er = celu_d ? celu_d + r * ldc : nullptr;
      switch (rows) {
        case 6: panel_tile512<6>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
        case 5: panel_tile512<5>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
        case 4: panel_tile512<4>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
        case 3: panel_tile512<3>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
        case 2: panel_tile512<2>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
        default: panel_tile512<1>(panels, ar, lda, w, k, kc, bias, accumulate, dr, ldd, cr, ldc, er, cols, tile_stream, act); break;
      }
    }
  }
}

// GCC 12 warns that its own AVX-512 headers read an uninitialised value (the
// `_mm512_undefined_*()` source of unmasked shuffles; GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Lane i of the result: the sum of v[i]'s 16 lanes, for i < 8 (24 operations
// for the 8 sums, instead of 8 full horizontal sums).
TF_AVX512_INLINE __m256 sums8(const __m512 (&v)[8]) {
  __m512 t[4];  // t[i]: v[2i] folded to 8 lanes, then v[2i + 1] folded
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  // s0: v[0..3] folded to 4 lanes each (one 128-bit block each), s1: v[4..7]
  const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88),
                                  _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88),
                                  _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  // block b: [pairs of v[b]], [pairs of v[b + 4]], then the sums in lanes 0 and 2
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, y));
}

// Rows 0..R of C[:, 0:8] = epilogue(G W^T) for 8 consecutive rows of W (k x
// n), read from its forward panels (`w`: the first of the 8 in panel 0, panel
// stride 16 k; n >= 16): per panel, 16 products of each (row, output) pair in
// a lane each, summed across lanes at the end. The empty asm keeps each W
// vector in a register for its R products (GCC otherwise reloads it from
// memory for every FMA: 27 loads per 24 FMAs), and the first panel starts the
// sums (g w is the FMA of g, w and 0), so that no zeroed accumulators go
// through memory.
template <int R, bool First>
TF_AVX512_INLINE void nt_step512(__m512 (&acc)[R][8], const float* g, int64_t ldg,
                                 const float* wp) {
  __m512 gv[R];
  for (int r = 0; r < R; ++r) gv[r] = _mm512_loadu_ps(g + r * ldg);
  for (int i = 0; i < 8; ++i) {
    __m512 wv = _mm512_loadu_ps(wp + 16 * i);
    asm("" : "+v"(wv));
    for (int r = 0; r < R; ++r)
      acc[r][i] = First ? _mm512_mul_ps(gv[r], wv) : _mm512_fmadd_ps(gv[r], wv, acc[r][i]);
  }
}

template <int R>
TF_AVX512 void nt_tile512(const float* g, int64_t ldg, const float* w, int64_t panel_stride,
                          int64_t n, bool accumulate, const float* d, int64_t ldd, float* c,
                          int64_t ldc) {
  __m512 acc[R][8];
  nt_step512<R, true>(acc, g, ldg, w);
  for (int64_t p = 16; p < n; p += 16) nt_step512<R, false>(acc, g + p, ldg, w + (p / 16) * panel_stride);
  for (int r = 0; r < R; ++r) {
    __m256 s = sums8(acc[r]);
    if (d != nullptr) s = _mm256_mul_ps(s, _mm256_loadu_ps(d + r * ldd));
    if (accumulate) s = _mm256_add_ps(s, _mm256_loadu_ps(c + r * ldc));
    _mm256_storeu_ps(c + r * ldc, s);
  }
}

// C (m x k) = G (m x n) W^T (times D, or added to C) for a few rows m, W given
// as its forward panels, with dot products (nt_tile512), k % 8 == 0, 16 <= n
// <= 1024. Each slab of 8 rows of W (8 x n) is copied to a contiguous buffer,
// which stays in L1 while tiles of 3 rows of G pass over it: read in place,
// its pieces sit 64 k bytes apart, a multiple of 4 KB for k = 64, 128, 192,
// ..., all in the same few L1 sets, and were evicted between tiles (54 GFLOP/s
// instead of about 150 for 60 x 384 x 256). A tile skips (0, or C kept) the
// chunks of c_chunks none of its rows wants.
TF_AVX512 inline void panel_nt_dot512(int64_t m, int64_t k, int64_t n, const float* g,
                                      int64_t ldg, const float* w, bool accumulate,
                                      const float* d, int64_t ldd, float* c, int64_t ldc,
                                      const uint64_t* c_chunks) {
  alignas(64) float slab[64 * 128];  // (n / 16) pieces of (8, 16)
  for (int64_t i = 0; i < k; i += 8) {
    const float* ws = w + 16 * i;
    int64_t stride = 16 * k;
    if (m > 3) {
      for (int64_t p = 0; p < n / 16; ++p)
        std::memcpy(slab + 128 * p, w + p * 16 * k + 16 * i, 128 * sizeof(float));
      ws = slab;
      stride = 128;
    }
    for (int64_t r = 0; r < m; r += 3) {
      const int64_t rows = std::min<int64_t>(3, m - r);
      float* cr = c + r * ldc + i;
      if (c_chunks != nullptr && ((chunks_of(c_chunks + r, rows) >> (i / 16)) & 1) == 0) {
        if (!accumulate)
          for (int64_t q = 0; q < rows; ++q) std::memset(cr + q * ldc, 0, 8 * sizeof(float));
        continue;
      }
      const float* gr = g + r * ldg;
      const float* dr = d != nullptr ? d + r * ldd + i : nullptr;
      switch (rows) {
        case 3: nt_tile512<3>(gr, ldg, ws, stride, n, accumulate, dr, ldd, cr, ldc); break;
        case 2: nt_tile512<2>(gr, ldg, ws, stride, n, accumulate, dr, ldd, cr, ldc); break;
        default: nt_tile512<1>(gr, ldg, ws, stride, n, accumulate, dr, ldd, cr, ldc); break;
      }
    }
  }
}

// dst[j * 16 + i] = src[i * 16 + j]: a contiguous 16 x 16 block transposed
// (4 rounds of 16 shuffles).
TF_AVX512_INLINE void transpose16x16(const float* src, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(dst + 16 * i, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
    _mm512_storeu_ps(dst + 16 * (8 + i), _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD));
  }
}

constexpr int64_t kNtSlabPanels = 2;  // W^T panels made at a time (32 columns of C)
constexpr int64_t kNtSlabMaxN = 256;  // their buffer: 2 x 256 x 16 floats (32 KB, L1)

// The same product from W^T panels made on the fly: each slab of 32 rows of W
// (32 x n) is transposed, 16 x 16 blocks at a time, into two W^T panels (n,
// 16) in an L1 buffer, which panel_gemm_avx512 then multiplies as it does the
// stored W^T panels: the same operations in the same order, so the same bits
// as the stored panels, without reading them (the forward pass has just
// brought W into cache; W^T would come from memory or L3). The transposes
// cost 4 shuffles per weight per call; one core, W in L2 (k x n = 384 x 256,
// GFLOP/s): 18 rows 123 against 117 for the dot products and 171 for stored
// W^T panels, 48 rows 158 / 123 / 176, 96 rows 171 / 128 / 176, 6 rows 77 /
// 90. k % 16 == 0, n % 16 == 0, n <= kNtSlabMaxN.
TF_AVX512 inline void panel_nt_transposed512(int64_t m, int64_t k, int64_t n, const float* g,
                                             int64_t ldg, const float* w, bool accumulate,
                                             const float* d, int64_t ldd, float* c, int64_t ldc,
                                             const uint64_t* c_chunks) {
  alignas(64) float slab[kNtSlabPanels * kNtSlabMaxN * 16];
  constexpr int64_t kRowsAtOnce = 96;  // rows per panel_gemm call (their shifted chunks below)
  uint64_t shifted[kRowsAtOnce];
  const uint64_t wanted_by_any = c_chunks != nullptr ? chunks_of(c_chunks, m) : kAllChunks;
  for (int64_t i0 = 0; i0 < k; i0 += 16 * kNtSlabPanels) {
    const int64_t panels = std::min<int64_t>(kNtSlabPanels, (k - i0) / 16);
    // (c_chunks, when given, cover k <= 1024 columns: 64 bits.)
    if (c_chunks != nullptr &&
        (wanted_by_any & (((uint64_t(1) << panels) - 1) << (i0 / 16))) == 0) {
      // no row wants these columns: 0, or C kept
      if (!accumulate)
        for (int64_t r = 0; r < m; ++r) std::memset(c + r * ldc + i0, 0, 16 * panels * sizeof(float));
      continue;
    }
    for (int64_t q = 0; q < panels; ++q)
      for (int64_t p = 0; p < n / 16; ++p)
        transpose16x16(w + p * 16 * k + 16 * (i0 + 16 * q), slab + q * n * 16 + 256 * p);
    for (int64_t r0 = 0; r0 < m; r0 += kRowsAtOnce) {
      const int64_t rows = std::min<int64_t>(kRowsAtOnce, m - r0);
      if (c_chunks != nullptr)
        for (int64_t r = 0; r < rows; ++r) shifted[r] = c_chunks[r0 + r] >> (i0 / 16);
      panel_gemm_avx512(rows, 16 * panels, n, g + r0 * ldg, ldg, slab, nullptr, accumulate,
                        d != nullptr ? d + r0 * ldd + i0 : nullptr, ldd, c + r0 * ldc + i0, ldc,
                        nullptr, c_chunks != nullptr ? shifted : nullptr, nullptr);
    }
  }
}

// From this many rows up panel_nt takes the transposed slabs (when n allows).
constexpr int64_t kNtTransposeMinRows = 9;

// C (m x k) = G (m x n) W^T (times D, or added to C), W given as its forward
// panels: panel_nt with AVX-512, k % 8 == 0, n % 16 == 0, n <= 1024.
TF_AVX512 inline void panel_nt_avx512(int64_t m, int64_t k, int64_t n, const float* g,
                                      int64_t ldg, const float* w, bool accumulate,
                                      const float* d, int64_t ldd, float* c, int64_t ldc,
                                      const uint64_t* c_chunks) {
  if (n == 0) {  // an empty sum
    if (!accumulate)
      for (int64_t r = 0; r < m; ++r) std::memset(c + r * ldc, 0, k * sizeof(float));
    return;
  }
  if (m >= kNtTransposeMinRows && k % 16 == 0 && n <= kNtSlabMaxN) {
    panel_nt_transposed512(m, k, n, g, ldg, w, accumulate, d, ldd, c, ldc, c_chunks);
    return;
  }
  panel_nt_dot512(m, k, n, g, ldg, w, accumulate, d, ldd, c, ldc, c_chunks);
}

#pragma GCC diagnostic pop

// Row r of C[:, 0:I] = epilogue(g_r W^T) for I <= 4 consecutive rows of W
// (k x n), read from W's forward panels: `w` points at the first of them in
// panel 0 (panel stride 16 k). Each accumulator holds 8 of the n products.
template <int I>
TF_AVX2_INLINE void panel_nt_row(const float* g, const float* w, int64_t k, int64_t n,
                                 bool accumulate, const float* d, float* c) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t p = 0; p < n; p += 16) {
    const float* wp = w + p * k;
    const __m256 g0 = _mm256_loadu_ps(g + p), g1 = _mm256_loadu_ps(g + p + 8);
    for (int i = 0; i < I; ++i) {
      acc[i] = _mm256_fmadd_ps(g0, _mm256_loadu_ps(wp + 16 * i), acc[i]);
      acc[i] = _mm256_fmadd_ps(g1, _mm256_loadu_ps(wp + 16 * i + 8), acc[i]);
    }
  }
  alignas(16) float s[4];
  _mm_store_ps(s, simd::hsum4(acc[0], acc[1], acc[2], acc[3]));
  for (int i = 0; i < I; ++i) {
    const float v = d != nullptr ? s[i] * d[i] : s[i];
    c[i] = accumulate ? c[i] + v : v;
  }
}

// C (m x k) = G (m x n) W^T for a few rows m, W (k x n) given as its forward
// panels (n/16 of (k, 16)); times D (ldd) if given, else stored or added.
// For one to a few rows the product is bound by reading W, and the forward
// pass has just brought these panels into cache, which W^T's panels are not.
// Row r skips (0, or C kept) the chunks not in c_chunks[r] (if given).
TF_AVX2 inline void panel_nt_avx2(int64_t m, int64_t k, int64_t n, const float* g, int64_t ldg,
                                  const float* w, bool accumulate, const float* d, int64_t ldd,
                                  float* c, int64_t ldc, const uint64_t* c_chunks) {
  for (int64_t r = 0; r < m; ++r) {
    const float* gr = g + r * ldg;
    const float* dr = d != nullptr ? d + r * ldd : nullptr;
    const uint64_t wanted = c_chunks != nullptr ? c_chunks[r] : kAllChunks;
    for (int64_t i = 0; i < k; i += 4) {
      const float* di = dr != nullptr ? dr + i : nullptr;
      if (((wanted >> (i / 16)) & 1) == 0) {
        if (!accumulate) std::memset(c + r * ldc + i, 0, std::min<int64_t>(4, k - i) * sizeof(float));
        continue;
      }
      switch (std::min<int64_t>(4, k - i)) {
        case 4: panel_nt_row<4>(gr, w + 16 * i, k, n, accumulate, di, c + r * ldc + i); break;
        case 3: panel_nt_row<3>(gr, w + 16 * i, k, n, accumulate, di, c + r * ldc + i); break;
        case 2: panel_nt_row<2>(gr, w + 16 * i, k, n, accumulate, di, c + r * ldc + i); break;
        default: panel_nt_row<1>(gr, w + 16 * i, k, n, accumulate, di, c + r * ldc + i); break;
      }
    }
  }
}

// c[r * ldc] = a_r . b + bias for the m rows a_r of A (m x k), b contiguous:
// 16 products per step in two accumulators, instead of one dependent
// scalar chain (the networks' last layer, a row per atom and member).
TF_AVX2 inline void dot_rows_avx2(int64_t m, int64_t k, const float* a, int64_t lda,
                                  const float* b, float bias, float* c, int64_t ldc) {
  for (int64_t r = 0; r < m; ++r) {
    const float* ar = a + r * lda;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(ar + p), _mm256_loadu_ps(b + p), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(ar + p + 8), _mm256_loadu_ps(b + p + 8), acc1);
    }
    if (p + 8 <= k) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(ar + p), _mm256_loadu_ps(b + p), acc0);
      p += 8;
    }
    float s = simd::hsum(_mm256_add_ps(acc0, acc1));
    for (; p < k; ++p) s += ar[p] * b[p];
    c[r * ldc] = s + bias;
  }
}

// The same in float64: 16 products per step in 4 accumulators (AVX-512 would
// gain nothing on 160 products).
TF_AVX2 inline void dot_rows_f64_avx2(int64_t m, int64_t k, const double* a, int64_t lda,
                                      const double* b, double bias, double* c, int64_t ldc) {
  for (int64_t r = 0; r < m; ++r) {
    const double* ar = a + r * lda;
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                      _mm256_setzero_pd()};
    int64_t p = 0;
    for (; p + 16 <= k; p += 16)
      for (int i = 0; i < 4; ++i)
        acc[i] = _mm256_fmadd_pd(_mm256_loadu_pd(ar + p + 4 * i), _mm256_loadu_pd(b + p + 4 * i), acc[i]);
    for (; p + 4 <= k; p += 4)
      acc[0] = _mm256_fmadd_pd(_mm256_loadu_pd(ar + p), _mm256_loadu_pd(b + p), acc[0]);
    const __m256d s4 = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    double s = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
    for (; p < k; ++p) s += ar[p] * b[p];
    c[r * ldc] = s + bias;
  }
}
#endif

}  // namespace torchani_fast::small_gemm
