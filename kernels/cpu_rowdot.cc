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
// contiguous (the [out, in] layout, like a tied LM head's embedding table). Needs AVX-512F,
// or AVX2 with FMA (the host's widest, chosen at compile time by -march=native; an AVX2
// host, such as an AMD Zen 3, has 16 vector registers of 8 floats instead of 32 of 16, so
// its tiles are narrower).
//
// Threads: XLA's own intra-op pool (Ctx<ThreadPool>). Work is split into chunks claimed from
// an atomic counter by the caller and by helpers it schedules. The caller never waits for a
// helper that has not started: several custom calls can run at once and fill the pool, and
// a caller that waited for queued helpers would deadlock. It waits only for chunks a running
// helper has claimed (spinning, then yielding the core). The shared state lives in a
// shared_ptr, since a late helper may start after the call returned (it then finds no chunk
// and exits).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <numeric>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One SIMD vector of floats and the four operations the tiles use. A tile of MR <= kRowTile
// rows of x times NT = kColTile[min(M, kRowTile)] rows of w keeps MR * NT accumulators in
// registers (with the NT weight vectors and one x vector, where they fit). Fewer rows of x
// take more rows of w at once: more independent FMA chains and loads in flight, without
// which one or two rows on AVX2 cannot keep up with memory (30 against XLA's 24-28 ms for
// one row of a SmolLM2 forward with 2 columns; 26 with 8).
#if defined(__AVX512F__)
using Vec = __m512;  // 32 registers: at most 24 accumulators + 4 + 1
constexpr int kLanes = 16, kRowTile = 6;
constexpr int kColTile[kRowTile + 1] = {0, 4, 4, 4, 4, 4, 4};
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;  // 16 registers: at most 12 accumulators + 2 + 1
constexpr int kLanes = 8, kRowTile = 6;
constexpr int kColTile[kRowTile + 1] = {0, 8, 6, 4, 3, 2, 2};
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#error "cpu_rowdot needs AVX-512F, or AVX2 with FMA (compile with -march=native on such a CPU)"
#endif

// A chunk of weight rows is whole tiles of every width.
constexpr int kChunkRows = std::lcm(std::lcm(std::lcm(kColTile[1], kColTile[2]),
                                             std::lcm(kColTile[3], kColTile[4])),
                                    std::lcm(kColTile[5], kColTile[6]));
static_assert(16 % kLanes == 0, "K % 16 == 0 must make every row whole vectors");

// MR rows of x times NT rows of w.
template <int MR, int NT>
void Tile(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m0,
          int64_t n0) {
  Vec acc[MR][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = Zero();
  for (int64_t k = 0; k < K; k += kLanes) {
    Vec wv[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) wv[t] = Load(w + (n0 + t) * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec xv = Load(x + (m0 + r) * K + k);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[r][t] = Fma(xv, wv[t], acc[r][t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) y[(m0 + r) * N + n0 + t] = Sum(acc[r][t]);
}

// All M rows of x against w rows [n0, n0 + NT): row groups of kRowTile, then the remainder.
// The NT weight rows stay in L1 across the groups, so w is read from memory once.
template <int NT>
void Rows(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
          int64_t n0) {
  static_assert(kRowTile == 6, "the remainder cases below are 5..1");
  int64_t m = 0;
  for (; m + kRowTile <= M; m += kRowTile) Tile<kRowTile, NT>(x, w, y, N, K, m, n0);
  switch (M - m) {
    case 5: Tile<5, NT>(x, w, y, N, K, m, n0); break;
    case 4: Tile<4, NT>(x, w, y, N, K, m, n0); break;
    case 3: Tile<3, NT>(x, w, y, N, K, m, n0); break;
    case 2: Tile<2, NT>(x, w, y, N, K, m, n0); break;
    case 1: Tile<1, NT>(x, w, y, N, K, m, n0); break;
    default: break;
  }
}

template <int NT>
void SpanOf(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
            int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) Rows<NT>(x, w, y, M, N, K, n);
  for (; n < n1; ++n) Rows<1>(x, w, y, M, N, K, n);
}

void Span(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
          int64_t n0, int64_t n1) {
  switch (std::min<int64_t>(M, kRowTile)) {
    case 1: return SpanOf<kColTile[1]>(x, w, y, M, N, K, n0, n1);
    case 2: return SpanOf<kColTile[2]>(x, w, y, M, N, K, n0, n1);
    case 3: return SpanOf<kColTile[3]>(x, w, y, M, N, K, n0, n1);
    case 4: return SpanOf<kColTile[4]>(x, w, y, M, N, K, n0, n1);
    case 5: return SpanOf<kColTile[5]>(x, w, y, M, N, K, n0, n1);
    default: return SpanOf<kColTile[6]>(x, w, y, M, N, K, n0, n1);
  }
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
  // About 64 KB of weights per chunk, rounded up to whole column tiles of every width.
  constexpr int64_t g = kChunkRows;
  work->rows_per_chunk = std::max<int64_t>(g, (16384 / K + g - 1) / g * g);
  work->chunks = (N + work->rows_per_chunk - 1) / work->rows_per_chunk;
  const int64_t helpers = std::max<int64_t>(1, pool.num_threads()) - 1;
  if (work->chunks > 4)
    for (int64_t p = 0; p < helpers; ++p) pool.Schedule([work] { work->Run(); });
  work->Run();
  // The last chunks are a running helper's. Spin briefly, then yield: on a loaded machine
  // (more runnable threads than cores) that helper may be waiting for this very core.
  for (int spins = 0; work->done.load(std::memory_order_acquire) < work->chunks; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowDot, RowDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
