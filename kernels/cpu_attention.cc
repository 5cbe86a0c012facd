// Attention of a few new tokens over a KV cache, for XLA:CPU, as an XLA FFI custom call.
//
//   y[b, t, h] = sum_s p[b, t, h, s] v[b, s, h / G],
//   p[b, t, h, :] = softmax over the visible s of  scale * q[b, t, h] . k[b, s, h / G]
//
// visible(b, t, s): s < L[b] (the committed prefix), or s = L[b] + j with j < R, s < S and
// mask[b, t, j] (the block's own rows: causal for a sequence, the ancestors for a tree). That
// is specjax.model.cache_mask's mask. A query that sees no row gets the mean of v over all S
// rows, which is what the model's dense softmax over a finite fill gives it.
//
// Why: a decode or verify step has T = 1..16 new tokens. XLA:CPU's einsums over the cache
// read all S rows (the capacity, not the L + R in use), transpose K and V to head-major
// first, and run a masked select over [B, Hkv, G, T, S]: at an 800-row prefix that was about
// 20 ms of a 36 ms SmolLM2 token. This kernel reads each visible K row and V row once per
// chunk of queries, in the cache's own [B, S, Hkv, Dh] layout.
//
// Layout: q, y [B, T, H, Dh] float32; k, v [B, S, Hkv, Dh] float32; L [B] int32; mask
// [B, T, R] bool; H = Hkv * G; Dh % kLanes == 0 (checked). Each query's result depends
// only on its own row, the rows it sees and the call's split count (below: its summation
// order), never on which other queries share its chunk.
//
// Work: one chunk per (b, KV head, group of up to kChunkQueries of that head's T * G
// queries, split of the visible rows), claimed as cpu_pool.h says. A chunk computes its
// queries' scores over its rows (each K row stays in L1 for all of them), their softmax in a
// scratch row per query, then P V in tiles of kQueryTile queries times kSlab vectors of Dh,
// so every accumulator is a register.
//
// Splits (flash-decoding's): at batch 1 a model with 3 KV heads has 3 chunks of one query
// group, and 3 chunks on 2 cores take 2 chunks' time; on 16 cores 13 sit idle. When that
// balance is poor and the cache is long, each group's rows [0, n) are cut into `splits`
// contiguous ranges; each range's softmax-weighted sum of V is written with its running max
// and sum of exps, and the calling thread combines them (y = sum_s w_s y_s, w_s = l_s
// exp(m_s - M) / sum_t l_t exp(m_t - M)). With one split the chunk writes y itself.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kSlab = 4, kQueryTile = 6;  // 24 accumulators + 4 V vectors of 32 registers
#else
constexpr int kSlab = 2, kQueryTile = 4;  // AVX2: 8 accumulators + 2 + a broadcast of 16
#endif
constexpr int64_t kChunkQueries = 12;
constexpr float kHidden = -3.0e38f;  // below any score, and finite: no inf - inf
// A split covers at least this many rows (below it a split's own fixed work costs more than
// the balance wins back), and a group is cut into at most kMaxSplits.
constexpr int64_t kMinSplitRows = 256, kMaxSplits = 16;

// How many splits balance base = B * Hkv * groups chunks over `threads` cores: the fewest
// that bring the critical path (chunks a core runs, in units of a whole group's rows) within
// 5% of the best any allowed count reaches. `rows` is the most rows a query may see.
int64_t ChooseSplits(int64_t base, int64_t threads, int64_t rows) {
  const int64_t most = std::clamp<int64_t>(rows / kMinSplitRows, 1, kMaxSplits);
  auto span = [&](int64_t s) {
    return static_cast<double>((base * s + threads - 1) / threads) / static_cast<double>(s);
  };
  double best = span(1);
  for (int64_t s = 2; s <= most; ++s) best = std::min(best, span(s));
  for (int64_t s = 1; s <= most; ++s)
    if (span(s) <= 1.05 * best) return s;
  return 1;
}

struct Attention : PoolWork {
  const float *q, *k, *v;
  const int32_t* lengths;
  const bool* mask;
  float* y;
  float scale;
  int64_t B, T, H, Hkv, G, S, R, Dh, groups_per_head, splits = 1;
  // With splits > 1: per (group chunk, split, query of the chunk) the range's normalised
  // output [Dh], its max score and its sum of exps (0: the range shows the query no row).
  std::vector<float> part_y, part_max, part_sum;

  // Where query i of a KV head (i = t * G + g) sits in q and y: [B, T, H, Dh], h = kvh * G + g.
  int64_t Offset(int64_t b, int64_t kvh, int64_t i) const {
    return ((b * T + i / G) * H + kvh * G + i % G) * Dh;
  }
  // Query group chunk gc: batch row b, KV head kvh, its queries [i0, i0 + nq).
  struct Group {
    int64_t b, kvh, i0, nq;
  };
  Group GroupOf(int64_t gc) const {
    const int64_t i0 = (gc % groups_per_head) * kChunkQueries;
    return {gc / (Hkv * groups_per_head), (gc / groups_per_head) % Hkv, i0,
            std::min<int64_t>(kChunkQueries, T * G - i0)};
  }
  // Where KV head kvh's cache row 0 of batch row b sits in k and v; rows are Hkv * Dh apart.
  int64_t HeadRow0(int64_t b, int64_t kvh) const { return (b * S * Hkv + kvh) * Dh; }
  int64_t Part(int64_t group_chunk, int64_t split, int64_t i) const {
    return (group_chunk * splits + split) * kChunkQueries + i;
  }
  // Rows [0, n) anyone in batch row b may see: the prefix, then the block's rows below S.
  int64_t Visible(int64_t b, int64_t* L) const {
    *L = std::clamp<int64_t>(lengths[b], 0, S);
    return *L + std::clamp<int64_t>(S - *L, 0, R);
  }

  void RunChunk(int64_t c) {
    const int64_t split = c % splits, gc = c / splits;
    const auto [b, kvh, i0, nq] = GroupOf(gc);
    int64_t L;
    const int64_t n = Visible(b, &L);
    // This split's rows [r0, r1): whole vectors of rows, the last split takes the rest.
    const int64_t per = ((n + splits - 1) / splits + kLanes - 1) / kLanes * kLanes;
    const int64_t r0 = std::min(n, split * per), r1 = std::min(n, r0 + per);
    const int64_t stride = Hkv * Dh;  // between cache rows
    const float* kb = k + HeadRow0(b, kvh) + r0 * stride;
    const float* vb = v + HeadRow0(b, kvh) + r0 * stride;
    const int64_t m = r1 - r0;
    // One scratch row of scores, then probabilities, per query, padded to whole vectors.
    const int64_t width = (m + kLanes - 1) / kLanes * kLanes;
    thread_local std::vector<float> scratch;
    scratch.resize(std::max<int64_t>(1, nq * width));
    float* p = scratch.data();
    const float* qs[kChunkQueries];
    for (int64_t i = 0; i < nq; ++i) qs[i] = q + Offset(b, kvh, i0 + i);

    // Scores kLanes rows at a time (the rows stay in L1 for every query), summed by one
    // transposing reduction; the last m % kLanes rows one by one.
    const Vec vscale = Set1(scale);
    int64_t s0 = 0;
    for (; s0 + kLanes <= m; s0 += kLanes) {
      for (int64_t i = 0; i < nq; ++i) {
        const float* qi = qs[i];
        Vec acc[kLanes];
#pragma GCC unroll 16
        for (int r = 0; r < kLanes; ++r) {
          const float* kr = kb + (s0 + r) * stride;
          acc[r] = Mul(Load(qi), Load(kr));
          for (int64_t d = kLanes; d < Dh; d += kLanes)
            acc[r] = Fma(Load(qi + d), Load(kr + d), acc[r]);
        }
        Store(p + i * width + s0, Mul(SumEach(acc), vscale));
      }
    }
    for (int64_t s = s0; s < m; ++s) {
      const float* kr = kb + s * stride;
      for (int64_t i = 0; i < nq; ++i) {
        const float* qi = qs[i];
        Vec acc = Mul(Load(qi), Load(kr));
        for (int64_t d = kLanes; d < Dh; d += kLanes) acc = Fma(Load(qi + d), Load(kr + d), acc);
        p[i * width + s] = Sum(acc) * scale;
      }
    }
    bool sees[kChunkQueries];  // false: the query sees no row of this range
    float* out[kChunkQueries];
    for (int64_t i = 0; i < nq; ++i) {
      const bool* seen = mask + (b * T + (i0 + i) / G) * R;  // seen[j]: tree row L + j
      float max = 0.0f, sum = 0.0f;
      sees[i] = Softmax(p + i * width, r0, m, width, L, seen, &max, &sum);
      if (splits == 1) {
        out[i] = y + Offset(b, kvh, i0 + i);
        if (!sees[i]) Mean(v + HeadRow0(b, kvh), stride, out[i]);
      } else {
        const int64_t at = Part(gc, split, i);
        out[i] = part_y.data() + at * Dh;
        part_max[at] = max;
        part_sum[at] = sees[i] ? sum : 0.0f;
      }
    }
    for (int64_t d0 = 0; d0 < Dh; d0 += kSlab * kLanes) {
      const int64_t nv = std::min<int64_t>(kSlab, (Dh - d0) / kLanes);
      for (int64_t i = 0; i < nq; i += kQueryTile) {
        float* dst[kQueryTile];
        const int64_t mt = std::min<int64_t>(kQueryTile, nq - i);
        for (int64_t r = 0; r < mt; ++r) dst[r] = sees[i + r] ? out[i + r] + d0 : nullptr;
        PV(p + i * width, width, vb + d0, stride, m, mt, nv, dst);
      }
    }
  }

  // After every chunk ran, with splits > 1: each query's output from its ranges' parts.
  void Combine() {
    std::vector<float> acc(Dh);
    for (int64_t gc = 0; gc < B * Hkv * groups_per_head; ++gc) {
      const auto [b, kvh, i0, nq] = GroupOf(gc);
      for (int64_t i = 0; i < nq; ++i) {
        float* out = y + Offset(b, kvh, i0 + i);
        float top = kHidden, total = 0.0f;
        for (int64_t s = 0; s < splits; ++s)
          if (part_sum[Part(gc, s, i)] > 0.0f) top = std::max(top, part_max[Part(gc, s, i)]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t at = Part(gc, s, i);
          if (part_sum[at] == 0.0f) continue;
          const float w = part_sum[at] * std::exp(part_max[at] - top);
          total += w;
          const float* ys = part_y.data() + at * Dh;
          for (int64_t d = 0; d < Dh; ++d) acc[d] += w * ys[d];
        }
        if (total == 0.0f) {
          Mean(v + HeadRow0(b, kvh), Hkv * Dh, out);
          continue;
        }
        for (int64_t d = 0; d < Dh; ++d) out[d] = acc[d] / total;
      }
    }
  }

  // Scores row[0, m) of cache rows [r0, r0 + m) -> probabilities over the visible ones
  // (cache row L + j is visible where seen[j]); hidden rows and the pad [m, width) become
  // exactly 0; *max and *sum get the visible scores' max and their exps' sum. False, with
  // row left unused, when the range shows the query no row.
  static bool Softmax(float* row, int64_t r0, int64_t m, int64_t width, int64_t L,
                      const bool* seen, float* max, float* sum) {
    auto hidden = [&](int64_t s) { return s >= m || (r0 + s >= L && !seen[r0 + s - L]); };
    const int64_t first = std::clamp<int64_t>(L - r0, 0, m);  // [0, first): prefix rows
    int64_t visible = first;
    for (int64_t s = first; s < width; ++s) {
      const bool ok = !hidden(s);
      visible += ok;
      if (!ok) row[s] = kHidden;
    }
    if (visible == 0) return false;
    Vec mx = Set1(kHidden);
    for (int64_t s = 0; s < width; s += kLanes) mx = Max(mx, Load(row + s));
    *max = MaxOf(mx);
    const Vec neg_max = Set1(-*max);
    for (int64_t s = 0; s < width; s += kLanes)
      Store(row + s, ExpNonPositive(Add(Load(row + s), neg_max)));
    // Hidden rows came out as exp(-87) ~ 1e-38, not 0: make them exactly 0 before the sum.
    for (int64_t s = first; s < width; ++s)
      if (hidden(s)) row[s] = 0.0f;
    Vec acc = Zero();
    for (int64_t s = 0; s < width; s += kLanes) acc = Add(acc, Load(row + s));
    *sum = Sum(acc);
    const Vec inv = Set1(1.0f / *sum);
    for (int64_t s = 0; s < width; s += kLanes) Store(row + s, Mul(Load(row + s), inv));
    return true;
  }

  // The dense softmax's answer for a query that sees no row: all S rows weighted 1 / S.
  void Mean(const float* vb, int64_t stride, float* out) const {
    std::vector<float> acc(Dh, 0.0f);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t d = 0; d < Dh; ++d) acc[d] += vb[s * stride + d];
    for (int64_t d = 0; d < Dh; ++d) out[d] = acc[d] / static_cast<float>(S);
  }

  // out[r][0, nv * kLanes) = sum_s prob[r][s] vs[s] for m <= kQueryTile queries (rows of
  // prob, width apart) and nv <= kSlab vectors; a null out[r] is not written.
  static void PV(const float* prob, int64_t width, const float* vs, int64_t stride, int64_t n,
                 int64_t m, int64_t nv, float* const* out) {
    Vec acc[kQueryTile][kSlab];
    for (int r = 0; r < kQueryTile; ++r)
      for (int j = 0; j < kSlab; ++j) acc[r][j] = Zero();
    for (int64_t s = 0; s < n; ++s) {
      Vec vr[kSlab];
      const float* row = vs + s * stride;
#pragma GCC unroll 4
      for (int j = 0; j < kSlab; ++j)
        if (j < nv) vr[j] = Load(row + j * kLanes);
#pragma GCC unroll 6
      for (int r = 0; r < kQueryTile; ++r) {
        if (r >= m) break;
        const Vec pr = Set1(prob[r * width + s]);
#pragma GCC unroll 4
        for (int j = 0; j < kSlab; ++j)
          if (j < nv) acc[r][j] = Fma(pr, vr[j], acc[r][j]);
      }
    }
    for (int r = 0; r < m; ++r)
      if (out[r] != nullptr)
        for (int j = 0; j < nv; ++j) Store(out[r] + j * kLanes, acc[r][j]);
  }
};

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> mask,
                              ffi::ResultBuffer<ffi::F32> y, float scale, int64_t splits) {
  const auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument("q must be [B, T, H, Dh], k and v [B, S, Hkv, Dh], "
                                       "mask [B, T, R]");
  const auto vd = v.dimensions();
  if (vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()) || kd[0] != qd[0] ||
      kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 || md[0] != qd[0] || md[1] != qd[1] ||
      lengths.element_count() != qd[0])
    return ffi::Error::InvalidArgument("q, k, v, lengths and mask disagree on B, T, H or Dh");
  if (splits < 0) return ffi::Error::InvalidArgument("splits must be >= 0 (0: chosen)");
  if (qd[3] == 0 || qd[3] % kLanes != 0)
    return ffi::Error::InvalidArgument("Dh must be a positive multiple of the vector width");
  auto work = std::make_shared<Attention>();
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->lengths = lengths.typed_data();
  work->mask = mask.typed_data();
  work->y = y->typed_data();
  work->scale = scale;
  work->B = qd[0];
  work->T = qd[1];
  work->H = qd[2];
  work->Dh = qd[3];
  work->S = kd[1];
  work->Hkv = kd[2];
  work->G = work->H / work->Hkv;
  work->R = md[2];
  work->groups_per_head = (work->T * work->G + kChunkQueries - 1) / kChunkQueries;
  if (work->T == 0 || work->S == 0) return ffi::Error::Success();
  const int64_t group_chunks = work->B * work->Hkv * work->groups_per_head;
  int64_t rows = 0, unused;
  for (int64_t b = 0; b < work->B; ++b) rows = std::max(rows, work->Visible(b, &unused));
  work->splits = splits > 0 ? std::min(splits, kMaxSplits)
                            : ChooseSplits(group_chunks, std::max<int64_t>(1, pool.num_threads()), rows);
  work->chunks = group_chunks * work->splits;
  if (work->splits > 1) {
    const int64_t parts = group_chunks * work->splits * kChunkQueries;
    work->part_y.resize(parts * work->Dh);
    work->part_max.resize(parts);
    work->part_sum.resize(parts);
  }
  RunOnPool(pool, work, /*min_chunks_to_share=*/1);
  if (work->splits > 1) work->Combine();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("splits"));
