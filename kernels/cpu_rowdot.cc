// Multi-row matrix-vector product for XLA:CPU, as an XLA FFI custom call.
//
//   y[m, n] = sum_k x[m, k] * w[n, k]      x [M, K], w [N, K] (rows are outputs), y [M, N]
//
// Why: a verify step multiplies T = 2..16 rows by every weight matrix. XLA:CPU sends M = 1 to
// a matrix-vector emitter that streams the weights at memory speed, and M >= 2 to a library
// GEMM that is far from it at small M (docs/benchmarks.md, issue 10). This kernel streams
// each weight row once and applies it to all M rows while it sits in registers, so M rows
// cost about what one does until the FMAs, not the memory, become the limit (M ~ 8 here).
//
// Invariants: float32; K % 16 == 0 (checked; every supported model's widths are); w rows
// contiguous (the [out, in] layout, like a tied LM head's embedding table). Needs AVX-512F.
//
// Threads: XLA's own intra-op pool (Ctx<ThreadPool>). Work is split into chunks claimed from
// an atomic counter by the caller and by helpers it schedules. The caller never waits for a
// helper that has not started: several custom calls can run at once and fill the pool, and
// a caller that waited for queued helpers would deadlock. It waits only for chunks a running
// helper has claimed. The shared state lives in a shared_ptr, since a late helper may start
// after the call returned (it then finds no chunk and exits).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// MR rows of x times NT rows of w: MR * NT accumulators (<= 24 of the 32 zmm registers).
template <int MR, int NT>
void Tile(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m0,
          int64_t n0) {
  __m512 acc[MR][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_ps(w + (n0 + t) * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + r) * K + k);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(xv, wv[t], acc[r][t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) y[(m0 + r) * N + n0 + t] = _mm512_reduce_add_ps(acc[r][t]);
}

// All M rows of x against w rows [n0, n0 + NT): row groups of 6, then the remainder.
template <int NT>
void Rows(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
          int64_t n0) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) Tile<6, NT>(x, w, y, N, K, m, n0);
  switch (M - m) {
    case 5: Tile<5, NT>(x, w, y, N, K, m, n0); break;
    case 4: Tile<4, NT>(x, w, y, N, K, m, n0); break;
    case 3: Tile<3, NT>(x, w, y, N, K, m, n0); break;
    case 2: Tile<2, NT>(x, w, y, N, K, m, n0); break;
    case 1: Tile<1, NT>(x, w, y, N, K, m, n0); break;
    default: break;
  }
}

void Span(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) Rows<4>(x, w, y, M, N, K, n);
  for (; n < n1; ++n) Rows<1>(x, w, y, M, N, K, n);
}

struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t M, N, K, rows_per_chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      const int64_t a = c * rows_per_chunk;
      Span(x, w, y, M, N, K, a, std::min(N, a + rows_per_chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error RowDotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("w must be [N, K]");
  const int64_t N = wd[0], K = wd[1];
  if (K % 16 != 0) return ffi::Error::InvalidArgument("K must be a multiple of 16");
  if (K == 0 || x.element_count() % K != 0)
    return ffi::Error::InvalidArgument("x's last axis must equal w's K");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->M = x.element_count() / K;
  work->N = N;
  work->K = K;
  // About 64 KB of weights per chunk, in whole groups of 4 rows.
  work->rows_per_chunk = std::max<int64_t>(4, (16384 / K + 3) / 4 * 4);
  work->chunks = (N + work->rows_per_chunk - 1) / work->rows_per_chunk;
  const int64_t helpers = std::max<int64_t>(1, pool.num_threads()) - 1;
  if (work->chunks > 4)
    for (int64_t p = 0; p < helpers; ++p) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowDot, RowDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
