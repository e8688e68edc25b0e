// Matrix products of the fused networks (ensemble/ensemble_cpu.cpp): few rows (at most
// one block of atoms) times one member's weights, row-major throughout.
//
//   panel_gemm(A, W)      = A W (+ bias, or + C; then * D, or CELU / GELU)
//                                                             float32, AVX2 + FMA or AVX-512
//   panel_nt(G, W)        = G W^T (+ C, or * D) from W's panels
//                                                             float32, AVX2 (1-2 rows) or AVX-512
//   gemm_bias(A, B, bias) = A B + bias                        any dtype, BLAS; one
//                           output column: dot products (AVX2, float32 and float64)
//   gemm_nt(A, B, D)      = (A B^T) * D, or C (+)= A B^T      any dtype, BLAS
//
// Zero chunks: panel_gemm may be given, per row, bitmasks of 16-column chunks
// (bit c: columns 16c .. 16c+15, at most 64 chunks). a_chunks: A's chunks
// that are not all zero; a tile of rows multiplies only the chunks set in any
// of its rows (the others add exact zeros). c_chunks: C's chunks wanted; a
// tile stores 0 (accumulating: leaves C) in the chunks none of its rows wants.
// panel_nt takes c_chunks likewise, per row.
//
// panel_gemm reads W as column panels of 16, each (k, 16) and contiguous (the
// "panels" nn.py packs once): a panel streams from memory once and stays in L1
// while every row of A is multiplied by it. For 4-64 rows this is about 2x a
// general BLAS call, which packs the weight matrix again on every call and
// reads it with a stride. The BLAS is the one torch links (sgemm_/dgemm_), or
// ATen's mm if torch exports none.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/simd_math.h"
#include "ensemble/gemm_panels.h"  // Activation; the SIMD panel kernels (x86-64)

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*,
            const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
// MKL's C entry (torch's x86 wheels); its lower-case alias is the Fortran one (int*).
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace torchani_fast::small_gemm {

// While alive, BLAS calls of this thread run on this thread only, with the
// same kernels whatever torch.set_num_threads says: MKL's dgemm gives other
// bits inside an OpenMP region than outside one with one thread (the float64
// networks differed in the last bit between 1 and 2 threads), and a threaded
// BLAS inside torchani_fast::parallel_for would oversubscribe the cores.
// available(): false when the BLAS is not MKL; callers then keep BLAS inside
// at::parallel_for.
class OneThreadBlas {
 public:
  static bool available() { return MKL_Set_Num_Threads_Local != nullptr; }
  OneThreadBlas() : previous_(available() ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~OneThreadBlas() {
    if (available()) MKL_Set_Num_Threads_Local(previous_);
  }
  OneThreadBlas(const OneThreadBlas&) = delete;
  OneThreadBlas& operator=(const OneThreadBlas&) = delete;

 private:
  int previous_;
};

// C (m x n) = op(A) op(B) + beta C, row-major (ta/tb: A/B stored transposed).
template <typename T>
void blas(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // Column-major BLAS sees every row-major matrix transposed: C^T = op(B)^T op(A)^T.
  const char tra = ta ? 'T' : 'N', trb = tb ? 'T' : 'N';
  const int im = static_cast<int>(n), in = static_cast<int>(m), ik = static_cast<int>(k);
  const int ilda = static_cast<int>(ldb), ildb = static_cast<int>(lda), ildc = static_cast<int>(ldc);
  const T one = 1;
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_ != nullptr) {
      sgemm_(&trb, &tra, &im, &in, &ik, &one, b, &ilda, a, &ildb, &beta, c, &ildc);
      return;
    }
  } else {
    if (dgemm_ != nullptr) {
      dgemm_(&trb, &tra, &im, &in, &ik, &one, b, &ilda, a, &ildb, &beta, c, &ildc);
      return;
    }
  }
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto view = [&](const T* p, int64_t rows, int64_t cols, int64_t ld, bool t) {
    auto x = at::from_blob(const_cast<T*>(p), {t ? cols : rows, t ? rows : cols}, {ld, 1}, opts);
    return t ? x.t() : x;
  };
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  at::Tensor prod = at::mm(view(a, m, k, lda, ta), view(b, k, n, ldb, tb));
  if (beta == T(0)) {
    out.copy_(prod);
  } else {
    out.add_(prod);
  }
}


// Whether panel_gemm can run here (float32, x86-64 with AVX2 and FMA).
inline bool panels_supported() {
#ifdef TF_SIMD_AVX2
  return simd::have_avx2();
#else
  return false;
#endif
}

// C (m x n) = epilogue(A W) as in panel_rows; n % 16 == 0; needs panels_supported().
// a_chunks / c_chunks: the zero chunks (per row, or nullptr; k / n <= 1024 when given).
// celu_d: C = act(A W + bias) (CELU(0.1) or GELU, `act`), its derivative into
// celu_d (not with c_chunks).
// next: next_floats floats read after this product, prefetched into L2 while
// its last group of panels runs (AVX-512; a hint, results do not depend on it).
inline void panel_gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                       const float* w, const float* bias, bool accumulate, const float* d,
                       int64_t ldd, float* c, int64_t ldc, const uint64_t* a_chunks = nullptr,
                       const uint64_t* c_chunks = nullptr, float* celu_d = nullptr,
                       const float* next = nullptr, int64_t next_floats = 0,
                       int64_t act = kCelu01) {
  TORCH_CHECK(celu_d == nullptr || c_chunks == nullptr, "panel_gemm: celu_d with c_chunks");
#ifdef TF_SIMD_AVX2
  if (simd::have_avx512()) {
    panel_gemm_avx512(m, n, k, a, lda, w, bias, accumulate, d, ldd, c, ldc, a_chunks, c_chunks,
                      celu_d, next, next_floats, act);
    return;
  }
  panel_gemm_avx2(m, n, k, a, lda, w, bias, accumulate, d, ldd, c, ldc, a_chunks, c_chunks, celu_d,
                  act);
#else
  TORCH_CHECK(false, "panel_gemm needs an x86-64 CPU with AVX2");
#endif
}

// Whether panel_nt runs as fast as panel_gemm on W^T's panels for any number
// of rows (panel_nt_avx512); otherwise it is for one or two rows.
inline bool panel_nt_any_rows(int64_t k, int64_t n) {
#ifdef TF_SIMD_AVX2
  return simd::have_avx512() && k % 8 == 0 && n <= 1024;
#else
  return false;
#endif
}

// C (m x k) = G W^T from W's forward panels, as panel_nt_avx2; n % 16 == 0;
// needs panels_supported(). c_chunks: C's chunks wanted (per row, or nullptr; k <= 1024).
inline void panel_nt(int64_t m, int64_t k, int64_t n, const float* g, int64_t ldg, const float* w,
                     bool accumulate, const float* d, int64_t ldd, float* c, int64_t ldc,
                     const uint64_t* c_chunks = nullptr) {
#ifdef TF_SIMD_AVX2
  if (panel_nt_any_rows(k, n)) {
    panel_nt_avx512(m, k, n, g, ldg, w, accumulate, d, ldd, c, ldc, c_chunks);
    return;
  }
  panel_nt_avx2(m, k, n, g, ldg, w, accumulate, d, ldd, c, ldc, c_chunks);
#else
  TORCH_CHECK(false, "panel_nt needs an x86-64 CPU with AVX2");
#endif
}

// C (m x n) = (A (m x k) B^T) * D elementwise (D: m x n, row stride ldd) when d
// is given, else C = A B^T (accumulate = false) or C += A B^T (accumulate = true).
// B is (n x k), row stride ldb.
template <typename T>
void gemm_nt(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
             T* c, int64_t ldc, const T* d, int64_t ldd, bool accumulate) {
  blas<T>(false, true, m, n, k, a, lda, b, ldb, accumulate ? T(1) : T(0), c, ldc);
  if (d != nullptr) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t q = 0; q < n; ++q) c[r * ldc + q] *= d[r * ldd + q];
  }
}

// C (m x n) = A (m x k) B (k x n) + bias (n,) broadcast over the rows.
template <typename T>
void gemm_bias(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
               const T* bias, T* c, int64_t ldc) {
  if (n == 1) {  // one output (the last layer): dot products
#ifdef TF_SIMD_AVX2
    if (ldb == 1 && simd::have_avx2()) {
      if constexpr (std::is_same_v<T, float>) {
        dot_rows_avx2(m, k, a, lda, b, bias[0], c, ldc);
        return;
      } else if constexpr (std::is_same_v<T, double>) {
        dot_rows_f64_avx2(m, k, a, lda, b, bias[0], c, ldc);
        return;
      }
    }
#endif
    for (int64_t r = 0; r < m; ++r) {
      T s = 0;
      for (int64_t p = 0; p < k; ++p) s += a[r * lda + p] * b[p * ldb];
      c[r * ldc] = s + bias[0];
    }
    return;
  }
  for (int64_t r = 0; r < m; ++r) std::memcpy(c + r * ldc, bias, n * sizeof(T));
  blas<T>(false, false, m, n, k, a, lda, b, ldb, T(1), c, ldc);
}

}  // namespace torchani_fast::small_gemm
