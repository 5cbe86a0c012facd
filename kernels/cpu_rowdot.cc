// Multi-row matrix-vector product for XLA:CPU, as an XLA FFI custom call.
//
//   y[m, n] = sum_k x[m, k] * w[n, k]      x [M, K], w [N, K] (rows are outputs), y [M, N]
//
// and its gathered form (SpecjaxRowDotGathered), a shortlist's logits with the gather fused:
//
//   y[m, c] = sum_k x[m, k] * w[idx[r, c], k]   idx [R, C] int32, r = 0 (R = 1) or m (R = M),
//                                                y = 0 where idx is outside [0, N)
//
// Why: a verify step multiplies T = 2..16 rows by every weight matrix. XLA:CPU sends M = 1 to
// a matrix-vector emitter that streams the weights at memory speed, and M >= 2 to a library
// GEMM that is far from it at small M (docs/benchmarks.md, issue 10). This kernel streams
// each weight row once and applies it to all M rows while it sits in registers, so M rows
// cost about what one does until the FMAs, not the memory, become the limit (M ~ 8 here).
//
// The gathered form serves DynaSpec's per-context shortlists on the CPU: XLA gathers the listed
// rows into a new [C, K] buffer and then reads it again; this reads each listed row once,
// straight from the table.
//
// Invariants: float32; K % 16 == 0 (checked; every supported model's widths are); w rows
// contiguous (the [out, in] layout, like a tied LM head's embedding table). Needs AVX-512F,
// or AVX2 with FMA (the host's widest, chosen at compile time by -march=native; an AVX2
// host, such as an AMD Zen 3, has 16 vector registers of 8 floats instead of 32 of 16, so
// its tiles are narrower).
//
// Threads: XLA's own intra-op pool, shared as cpu_pool.h says. SIMD: cpu_simd.h.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A tile of MR <= kRowTile rows of x times NT = kColTile[min(M, kRowTile)] rows of w keeps
// MR * NT accumulators in registers (with the NT weight vectors and one x vector, where they
// fit). Fewer rows of x take more rows of w at once: more independent FMA chains and loads
// in flight, without which one or two rows on AVX2 cannot keep up with memory (30 against
// XLA's 24-28 ms for one row of a SmolLM2 forward with 2 columns; 26 with 8). The same holds
// on AVX-512: 8/8/6/6/5 columns for 1..5 rows instead of 4 took 3-5% off a SmolLM2 forward
// at T = 1..4 (examples/rowdot_revision_ab.py, six runs; docs/benchmarks.md), with the
// larger chunks their least common multiple makes (below); chunks of each call's own tile
// width kept T = 4 at the old speed.
constexpr int kRowTile = 6;
#if defined(__AVX512F__)
constexpr int kColTile[kRowTile + 1] = {0, 8, 8, 6, 6, 5, 4};  // <= 24 accumulators + 6 + 1 of 32
#else
constexpr int kColTile[kRowTile + 1] = {0, 8, 6, 4, 3, 2, 2};  // AVX2: <= 12 + 2 + 1 of 16
#endif

// A chunk of weight rows is whole tiles of every width.
constexpr int kChunkRows = std::lcm(std::lcm(std::lcm(kColTile[1], kColTile[2]),
                                             std::lcm(kColTile[3], kColTile[4])),
                                    std::lcm(kColTile[5], kColTile[6]));
static_assert(16 % kLanes == 0, "K % 16 == 0 must make every row whole vectors");

// Every column tile asks for the next one's weight rows while it works on its own, one
// prefetch per cache line, into L2 (_MM_HINT_T1), shared among its passes over x's rows
// (Rows, below). Unasked, a tile with several rows of x keeps each weight row busy in the
// FMAs and the next rows arrive only when they are loaded: the memory stream and the FMAs
// take turns instead of overlapping. Until the fifty-ninth session the prefetch went into L1
// (T0) and only from three rows on; into L2 from one row, a SmolLM2 LM head (113 MB) at
// M = 1 / 2 / 4 / 6 takes 0.85 / 0.81 / 0.75 / 0.68 of that kernel's time on this Zen 4 host
// (in-process A/B; T2 reads as T1, NTA as T0, and asking 2-8 tiles ahead is no better than
// one; docs/benchmarks.md, fifty-ninth session). A likely reason: an L1 prefetch holds one of
// the core's few L1 miss buffers until its line arrives, where an L2 one leaves them to the
// tile's own loads, which then hit in L2.
constexpr int kLineFloats = 16;  // one 64-byte cache line

// x's vector pinned in a register (Tile's kPin) pays in every pass where loads are 512 bits
// wide. In the AVX2 build it pays only in the passes after the first, which compute from L1
// and would wait on the load ports. In the first pass, paced by the weights' stream, the pin
// cost 1.02-1.03 of the products' time at 1-6 rows on a Zen 3 host (AVX2, no AVX-512); likely
// a 256-bit load folded into an FMA costs nothing while the loop waits on memory. Pinned in
// the later passes only, with the shared prefetch (Rows), a SmolLM2 forward at 10-16 rows took
// 0.93-0.94 of the old AVX2 loop's time there, and 1-6 rows were level (docs/benchmarks.md,
// eighty-fifth session). The seventieth session had found both changes slower in the AVX2
// build, but ran it on a Zen 4.
#if defined(__AVX512F__)
constexpr bool kPinFirst = true;
#else
constexpr bool kPinFirst = false;
#endif

// Where output column j's weight row lives. Dense: row j of w (rowdot). Gathered: row
// idx[j] of w, or a row of zeros for a padding id outside [0, N), whose output is then
// written as exactly 0 (rowdot_gathered). ``At`` clamps j to the last column, so a tile may
// name the columns after the last one for its prefetch.
struct Dense {
  static constexpr bool kGathered = false;
  const float* w;
  int64_t K, cols;
  const float* At(int64_t j) const { return w + std::min(j, cols - 1) * K; }
  bool Valid(int64_t) const { return true; }
};

struct Gathered {
  static constexpr bool kGathered = true;
  const float* w;
  const int32_t* idx;
  const float* zeros;  // K floats
  int64_t K, cols, N;  // cols = C outputs, N = rows of w
  bool Valid(int64_t j) const { return idx[j] >= 0 && idx[j] < N; }
  const float* At(int64_t j) const {
    j = std::min(j, cols - 1);
    return Valid(j) ? w + static_cast<int64_t>(idx[j]) * K : zeros;
  }
};

// MR rows of x times the weight rows of columns [n0, n0 + NT), into y (row stride
// ``src.cols``). ``kPrefetch``: also ask for this tile's share of the rows of columns
// [n0 + NT, n0 + 2 NT): the pass-th of ``passes`` contiguous blocks of each row's cache
// lines (a template argument: a ragged end's single columns run without it). ``kPin``: hold
// x's vector in a register (kPinFirst, above).
//
// Blocks, not every passes-th line, since the ninety-first session: with two passes the
// second pass asked for the odd lines, and (the likely cause: asking for whole line pairs
// recovered most of the loss) an Intel core's L2 spatial prefetcher had already fetched
// each of them as the partner of the first pass's even line, so the memory idled through
// the second pass. On an Intel Xeon (AVX-512, two cores) a SmolLM2 forward at 8-12 rows
// took 0.79-0.82 of its time with blocks, 14-16 rows 0.92-0.93, 1-6 rows level
// (one pass asks for every line, as before; examples/rowdot_revision_ab.py,
// docs/benchmarks.md). Not measured on an AMD host.
template <int MR, int NT, bool kPrefetch, bool kPin, class Src>
void Tile(const float* x, const Src& src, float* y, int64_t K, int64_t m0, int64_t n0,
          int64_t pass, int64_t passes) {
  Vec acc[MR][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = Zero();
  const float* row[NT];
  const float* next[NT];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    row[t] = src.At(n0 + t);
    if constexpr (kPrefetch) next[t] = src.At(n0 + NT + t);
  }
  // This pass asks for lines [pass * share, (pass + 1) * share) of each next row, one line
  // per ``passes`` lines of its own loop: ceil(lines / passes) = share requests. A last
  // block that runs past the row (lines % passes != 0) asks for lines after it, the next
  // row's or past the last row's end: harmless, a prefetch never faults.
  const int64_t share = (K / kLineFloats + passes - 1) / passes;
  int64_t at = pass * share * kLineFloats, due = 0;
  for (int64_t k = 0; k < K; k += kLanes) {
    if constexpr (kPrefetch) {
      if (k == due) {
        due += passes * kLineFloats;
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t)
          _mm_prefetch(reinterpret_cast<const char*>(next[t] + at), _MM_HINT_T1);
        at += kLineFloats;
      }
    }
    Vec wv[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) wv[t] = Load(row[t] + k);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      Vec xv = Load(x + (m0 + r) * K + k);
      // Keep x's vector in a register. Left free, GCC folds the load into each of the NT
      // FMAs (vfmadd231ps mem, w, acc): NT loads of the same line instead of one, 28 loads
      // per 24 FMAs on a 6x4 tile, plus the prefetches, so the tile waits on the load ports
      // at about 70% of the FMA peak even with w in L1 (a standalone copy of this loop on
      // Zen 4, one core: 40 -> 54 GFMA/s from L1, 27 -> 53 from L2, 21 -> 38 from memory).
      if constexpr (kPin) KeepInRegister(xv);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[r][t] = Fma(xv, wv[t], acc[r][t]);
    }
  }
  // The MR * NT horizontal sums, kLanes at a time by one transposing tree of adds
  // (SumEach) instead of one reduction each. Every output's lanes are added in the same
  // order whatever its place in the tile (the unused places are zeros), so a row's products
  // have the same bits at every M, as with one reduction each: the kernel puts no
  // difference between a verify step's rows and a decode step's.
  constexpr int kSums = MR * NT, kGroups = (kSums + kLanes - 1) / kLanes;
  alignas(64) float sums[kGroups * kLanes];
#pragma GCC unroll 4
  for (int g = 0; g < kGroups; ++g) {
    Vec v[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) {
      const int a = g * kLanes + i;
      v[i] = a < kSums ? acc[a / NT][a % NT] : Zero();
    }
    Store(sums + g * kLanes, SumEach(v));
  }
  const int64_t ld = src.cols;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      float v = sums[r * NT + t];
      // 0 * inf in x would make a padding column NaN; its output is 0 by definition.
      if constexpr (Src::kGathered) v = src.Valid(n0 + t) ? v : 0.0f;
      y[(m0 + r) * ld + n0 + t] = v;
    }
}

// One pass: rows [m, m + rows) of x, rows <= kRowTile, against columns [n0, n0 + NT).
template <int NT, bool kPrefetch, bool kPin, class Src>
void Pass(const float* x, const Src& src, float* y, int64_t rows, int64_t K, int64_t m,
          int64_t n0, int64_t pass, int64_t passes) {
  static_assert(kRowTile == 6, "the cases below are 6..1");
  switch (rows) {
    case 6: return Tile<6, NT, kPrefetch, kPin>(x, src, y, K, m, n0, pass, passes);
    case 5: return Tile<5, NT, kPrefetch, kPin>(x, src, y, K, m, n0, pass, passes);
    case 4: return Tile<4, NT, kPrefetch, kPin>(x, src, y, K, m, n0, pass, passes);
    case 3: return Tile<3, NT, kPrefetch, kPin>(x, src, y, K, m, n0, pass, passes);
    case 2: return Tile<2, NT, kPrefetch, kPin>(x, src, y, K, m, n0, pass, passes);
    case 1: return Tile<1, NT, kPrefetch, kPin>(x, src, y, K, m, n0, pass, passes);
    default: return;
  }
}

// All M rows of x against columns [n0, n0 + NT), in passes over x's rows. The NT weight rows
// stay in L1 across the passes, so w is read from memory once, by the first pass, which hides
// up to kRowTile rows' FMAs under that stream; the later passes compute from L1. Every pass
// asks for its share of the next tile's rows: when the first pass asked for the whole next
// tile, the memory idled through the later passes and they added their full time. Spread
// over every pass, a forward's products at 12 / 14 rows took 0.82 / 0.87 of the time (with
// x's vector held in a register: without it, the later passes' extra prefetches made them
// slower, 1.04 / 1.06). The first pass takes kRowTile rows and the rest share the others
// evenly: 14 rows as 6 + 4 + 4 took 0.95 of 6 + 6 + 2's time, whose last pass of 2 rows
// loads 6 vectors for 8 FMAs (docs/benchmarks.md, seventieth session). The later passes
// always hold x in a register; the first does where kPinFirst says.
template <int NT, bool kPrefetch, class Src>
void Rows(const float* x, const Src& src, float* y, int64_t M, int64_t K, int64_t n0) {
  const int64_t passes = (M + kRowTile - 1) / kRowTile;
  for (int64_t m = 0, pass = 0; pass < passes; ++pass) {
    const int64_t left = passes - pass;  // passes left, this one included
    const int64_t rows =
        pass > 0 ? (M - m + left - 1) / left : std::min<int64_t>(M - m, kRowTile);
    if (pass == 0) {
      Pass<NT, kPrefetch, kPinFirst>(x, src, y, rows, K, m, n0, pass, passes);
    } else {
      Pass<NT, kPrefetch, true>(x, src, y, rows, K, m, n0, pass, passes);
    }
    m += rows;
  }
}

// Columns [n0, n1): whole tiles, which prefetch (for a gathered source too, where no
// hardware prefetcher could guess the next row), then single columns for a ragged end.
template <int NT, class Src>
void SpanOf(const float* x, const Src& src, float* y, int64_t M, int64_t K, int64_t n0,
            int64_t n1) {
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) Rows<NT, true>(x, src, y, M, K, n);
  for (; n < n1; ++n) Rows<1, false>(x, src, y, M, K, n);
}

template <class Src>
void Span(const float* x, const Src& src, float* y, int64_t M, int64_t K, int64_t n0,
          int64_t n1) {
  switch (std::min<int64_t>(M, kRowTile)) {
    case 1: return SpanOf<kColTile[1]>(x, src, y, M, K, n0, n1);
    case 2: return SpanOf<kColTile[2]>(x, src, y, M, K, n0, n1);
    case 3: return SpanOf<kColTile[3]>(x, src, y, M, K, n0, n1);
    case 4: return SpanOf<kColTile[4]>(x, src, y, M, K, n0, n1);
    case 5: return SpanOf<kColTile[5]>(x, src, y, M, K, n0, n1);
    default: return SpanOf<kColTile[6]>(x, src, y, M, K, n0, n1);
  }
}

// One call's work: ``groups`` independent products (one for rowdot and for a shared gathered
// shortlist; one per row of x for per-row shortlists), each cut into chunks of
// ``cols_per_chunk`` output columns, claimed from an atomic counter.
struct Work : PoolWork {
  const float* x;
  const float* w;
  const int32_t* idx = nullptr;  // [groups or 1, cols]; null for rowdot
  std::vector<float> zeros;
  float* y;
  int64_t M, N, K, cols, groups, cols_per_chunk, chunks_per_group;

  void RunChunk(int64_t c) {
    const int64_t rows = M / groups;  // rows of x per group
    const int64_t g = c / chunks_per_group;
    const int64_t a = (c % chunks_per_group) * cols_per_chunk;
    const int64_t b = std::min(cols, a + cols_per_chunk);
    const float* xg = x + g * rows * K;
    float* yg = y + g * rows * cols;
    if (idx == nullptr) {
      Span(xg, Dense{w, K, cols}, yg, rows, K, a, b);
    } else {
      Span(xg, Gathered{w, idx + g * cols, zeros.data(), K, cols, N}, yg, rows, K, a, b);
    }
  }
};

// Runs ``work`` on the caller and XLA's pool. At least 64 KB of weights per chunk, rounded
// up to whole column tiles of every width (120 columns with AVX-512's widths: 276 KB at
// K = 576).
void Run(ffi::ThreadPool& pool, const std::shared_ptr<Work>& work) {
  constexpr int64_t g = kChunkRows;
  work->cols_per_chunk = std::max<int64_t>(g, (16384 / work->K + g - 1) / g * g);
  work->chunks_per_group = (work->cols + work->cols_per_chunk - 1) / work->cols_per_chunk;
  work->chunks = work->groups * work->chunks_per_group;
  RunOnPool(pool, work, /*min_chunks_to_share=*/4);
}

// The checks both products share: w is [N, K] with K % 16 == 0, and x's last axis is K.
ffi::Error CheckOperands(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("w must be [N, K]");
  if (wd[1] % 16 != 0) return ffi::Error::InvalidArgument("K must be a multiple of 16");
  if (wd[1] == 0 || x.element_count() % wd[1] != 0)
    return ffi::Error::InvalidArgument("x's last axis must equal w's K");
  return ffi::Error::Success();
}

std::shared_ptr<Work> NewWork(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w,
                              float* y) {
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y;
  work->N = w.dimensions()[0];
  work->K = w.dimensions()[1];
  work->M = x.element_count() / work->K;
  return work;
}

ffi::Error RowDotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (auto err = CheckOperands(x, w); err.failure()) return err;
  auto work = NewWork(x, w, y->typed_data());
  work->cols = work->N;
  work->groups = 1;
  Run(pool, work);
  return ffi::Error::Success();
}

// idx [R, C] int32 with R = 1 (one shortlist for every row of x) or R = M (one per row).
ffi::Error RowDotGatheredImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> idx,
                              ffi::ResultBuffer<ffi::F32> y) {
  if (auto err = CheckOperands(x, w); err.failure()) return err;
  const auto id = idx.dimensions();
  if (id.size() != 2) return ffi::Error::InvalidArgument("idx must be [R, C]");
  auto work = NewWork(x, w, y->typed_data());
  if (id[0] != 1 && id[0] != work->M)
    return ffi::Error::InvalidArgument("idx must have one row, or one per row of x");
  work->idx = idx.typed_data();
  work->zeros.assign(work->K, 0.0f);
  work->cols = id[1];
  work->groups = id[0];
  if (work->cols > 0) Run(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowDot, RowDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowDotGathered, RowDotGatheredImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
