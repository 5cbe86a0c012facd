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
// only on its own row, the rows it sees, the call's split count and its score layout (their
// summation orders), never on which other queries share its chunk.
//
// Work: one chunk per (b, KV head, group of that head's T * G queries, split of the visible
// rows), claimed as cpu_pool.h says. A chunk computes its queries' scores over its rows (each
// K row stays in L1 for all of them), their softmax, then P V in tiles of kQueryTile queries
// times kSlab vectors of Dh, so every accumulator is a register. The scores come in one of
// two layouts, chosen per call from T * G (`scores`, below):
//  - dots: a group of up to kChunkQueries queries; per query, kLanes rows' dot products
//    summed by one transposing reduction, into a scratch row of scores per query. Each score
//    costs two vector loads per FMA and a share of the reduction, but every lane is used
//    however few the queries (a decode step has G of them).
//  - lanes: a group of up to kLanes queries, one per lane; per cache row, one vector of all
//    the group's scores, sum_d k[s, d] q[:, d] (the k element broadcast, q packed
//    d-major once per chunk), kRowTile rows at a time: one FMA per row and d, no reduction.
//    The softmax then runs down the rows for every query at once. Empty lanes cost as much as
//    full ones, so this layout is taken only where its groups fill 3/4 of the lanes.
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
#include <limits>
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
constexpr int64_t kChunkQueries = 12;  // the dots layout's queries a chunk
constexpr int64_t kMaxGroup = kChunkQueries > kLanes ? kChunkQueries : kLanes;
constexpr int kRowTile = 8;  // the lanes layout's rows a tile: 8 accumulators hide FMA latency
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
  bool lanes = false;         // the score layout (above); false: dots
  int64_t group_size = kChunkQueries;  // the most queries a chunk takes
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
    const int64_t i0 = (gc % groups_per_head) * group_size;
    return {gc / (Hkv * groups_per_head), (gc / groups_per_head) % Hkv, i0,
            std::min<int64_t>(group_size, T * G - i0)};
  }
  // Where KV head kvh's cache row 0 of batch row b sits in k and v; rows are Hkv * Dh apart.
  int64_t HeadRow0(int64_t b, int64_t kvh) const { return (b * S * Hkv + kvh) * Dh; }
  int64_t Part(int64_t group_chunk, int64_t split, int64_t i) const {
    return (group_chunk * splits + split) * group_size + i;
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
    const float* qs[kMaxGroup];
    const bool* seen[kMaxGroup];  // seen[i][j]: query i sees block row L + j
    for (int64_t i = 0; i < nq; ++i) {
      qs[i] = q + Offset(b, kvh, i0 + i);
      seen[i] = mask + (b * T + (i0 + i) / G) * R;
    }
    // Query i's weight of row s sits at p[i * qstride + s * sstride]; the dots layout's are
    // normalised, the lanes layout's are scaled by inv[i] at the end.
    float max[kMaxGroup], sum[kMaxGroup], inv[kMaxGroup];
    bool sees[kMaxGroup];  // false: the query sees no row of this range
    thread_local std::vector<float> scratch;
    float* p;
    int64_t qstride, sstride;
    if (lanes) {
      scratch.resize(std::max<int64_t>(1, m * kLanes));
      p = scratch.data();
      qstride = 1;
      sstride = kLanes;
      LaneScores(qs, nq, kb, stride, m, p);
      LaneSoftmax(p, r0, m, L, seen, nq, max, sum);
      for (int64_t i = 0; i < nq; ++i) {
        sees[i] = sum[i] > 0.0f;  // a visible row adds exp(0) = 1
        inv[i] = sees[i] ? 1.0f / sum[i] : 0.0f;
      }
    } else {
      // One scratch row of scores, then probabilities, per query, padded to whole vectors.
      const int64_t width = (m + kLanes - 1) / kLanes * kLanes;
      scratch.resize(std::max<int64_t>(1, nq * width));
      p = scratch.data();
      qstride = width;
      sstride = 1;
      DotScores(qs, nq, kb, stride, m, width, p);
      for (int64_t i = 0; i < nq; ++i) {
        max[i] = sum[i] = 0.0f;
        sees[i] = Softmax(p + i * width, r0, m, width, L, seen[i], &max[i], &sum[i]);
        inv[i] = 1.0f;
      }
    }
    float* out[kMaxGroup];
    for (int64_t i = 0; i < nq; ++i) {
      if (splits == 1) {
        out[i] = y + Offset(b, kvh, i0 + i);
        if (!sees[i]) Mean(v + HeadRow0(b, kvh), stride, out[i]);
      } else {
        const int64_t at = Part(gc, split, i);
        out[i] = part_y.data() + at * Dh;
        part_max[at] = max[i];
        part_sum[at] = sees[i] ? sum[i] : 0.0f;
      }
    }
    for (int64_t d0 = 0; d0 < Dh; d0 += kSlab * kLanes) {
      const int64_t nv = std::min<int64_t>(kSlab, (Dh - d0) / kLanes);
      for (int64_t i = 0; i < nq; i += kQueryTile) {
        float* dst[kQueryTile];
        const int64_t mt = std::min<int64_t>(kQueryTile, nq - i);
        for (int64_t r = 0; r < mt; ++r) dst[r] = sees[i + r] ? out[i + r] + d0 : nullptr;
        PV(p + i * qstride, qstride, sstride, inv + i, vb + d0, stride, m, mt, nv, dst);
      }
    }
  }

  // The dots layout's scores: p[i * width + s] = scale * q_i . k_s for rows s in [0, m), kLanes
  // rows at a time (the rows stay in L1 for every query) summed by one transposing
  // reduction; the last m % kLanes rows one by one.
  void DotScores(const float* const* qs, int64_t nq, const float* kb, int64_t stride,
                 int64_t m, int64_t width, float* p) const {
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
  }

  // The lanes layout's scores: p[s * kLanes + i] = scale * q_i . k_s for the nq <= kLanes
  // queries and rows s in [0, m); lanes from nq on get 0. Every lane sums over d in order,
  // whichever tile its row falls in.
  void LaneScores(const float* const* qs, int64_t nq, const float* kb, int64_t stride,
                  int64_t m, float* p) const {
    thread_local std::vector<float> packed;  // [Dh, kLanes]: q's d-th elements, one a lane
    packed.assign(Dh * kLanes, 0.0f);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t d = 0; d < Dh; ++d) packed[d * kLanes + i] = qs[i][d];
    const Vec vscale = Set1(scale);
    int64_t s = 0;
    for (; s + kRowTile <= m; s += kRowTile)
      ScoreTile<kRowTile>(packed.data(), kb + s * stride, stride, Dh, vscale, p + s * kLanes);
    for (; s < m; ++s) ScoreTile<1>(packed.data(), kb + s * stride, stride, Dh, vscale,
                                     p + s * kLanes);
  }

  // out[r * kLanes, +kLanes) = scale * (row r's scores), rows N of them, stride apart from k0.
  template <int N>
  static void ScoreTile(const float* packed, const float* k0, int64_t stride, int64_t dh,
                        Vec vscale, float* out) {
    Vec acc[N];
    for (int r = 0; r < N; ++r) acc[r] = Zero();
    for (int64_t d = 0; d < dh; ++d) {
      const Vec qd = Load(packed + d * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) acc[r] = Fma(Set1(k0[r * stride + d]), qd, acc[r]);
    }
    for (int r = 0; r < N; ++r) Store(out + r * kLanes, Mul(acc[r], vscale));
  }

  // The lanes layout's softmax, down rows [0, m) (cache rows r0 + s) for every lane at once:
  // a visible (query, row) pair gets exp(score - the query's max), a hidden one exactly 0,
  // unnormalised; max[i] and sum[i] for each of the nq queries (sum 0: the range shows query
  // i no row). Rows below L are every query's; the rest are block rows, seen per query.
  static void LaneSoftmax(float* p, int64_t r0, int64_t m, int64_t L,
                          const bool* const* seen, int64_t nq, float* max, float* sum) {
    const int64_t first = std::clamp<int64_t>(L - r0, 0, m);
    // Per block row and lane: keep 1 or 0, and a bound that leaves a seen score as it is and
    // puts a hidden one below every score (so it never becomes the max).
    thread_local std::vector<float> keep, bound;
    keep.assign((m - first) * kLanes, 0.0f);
    bound.assign((m - first) * kLanes, kHidden);
    for (int64_t s = first; s < m; ++s)
      for (int64_t i = 0; i < nq; ++i)
        if (seen[i][r0 + s - L]) {
          keep[(s - first) * kLanes + i] = 1.0f;
          bound[(s - first) * kLanes + i] = std::numeric_limits<float>::max();
        }
    Vec mx = Set1(kHidden);
    for (int64_t s = 0; s < first; ++s) mx = Max(mx, Load(p + s * kLanes));
    for (int64_t s = first; s < m; ++s) {
      const Vec x = Min(Load(bound.data() + (s - first) * kLanes), Load(p + s * kLanes));
      Store(p + s * kLanes, x);
      mx = Max(mx, x);
    }
    const Vec neg_max = Mul(mx, Set1(-1.0f));
    Vec acc = Zero();
    for (int64_t s = 0; s < m; ++s) {
      Vec e = ExpNonPositive(Add(Load(p + s * kLanes), neg_max));
      if (s >= first) e = Mul(e, Load(keep.data() + (s - first) * kLanes));
      Store(p + s * kLanes, e);
      acc = Add(acc, e);
    }
    float lane_max[kLanes], lane_sum[kLanes];
    Store(lane_max, mx);
    Store(lane_sum, acc);
    std::copy(lane_max, lane_max + nq, max);
    std::copy(lane_sum, lane_sum + nq, sum);
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

  // out[r][0, nv * kLanes) = inv[r] * sum_s prob[r * qstride + s * sstride] vs[s] for
  // m <= kQueryTile queries and nv <= kSlab vectors; a null out[r] is not written.
  static void PV(const float* prob, int64_t qstride, int64_t sstride, const float* inv,
                 const float* vs, int64_t stride, int64_t n, int64_t m, int64_t nv,
                 float* const* out) {
    Vec acc[kQueryTile][kSlab];
    for (int r = 0; r < kQueryTile; ++r)
      for (int j = 0; j < kSlab; ++j) acc[r][j] = Zero();
    for (int64_t s = 0; s < n; ++s) {
      Vec vr[kSlab];
      const float* row = vs + s * stride;
      const float* ps = prob + s * sstride;
#pragma GCC unroll 4
      for (int j = 0; j < kSlab; ++j)
        if (j < nv) vr[j] = Load(row + j * kLanes);
#pragma GCC unroll 6
      for (int r = 0; r < kQueryTile; ++r) {
        if (r >= m) break;
        const Vec pr = Set1(ps[r * qstride]);
#pragma GCC unroll 4
        for (int j = 0; j < kSlab; ++j)
          if (j < nv) acc[r][j] = Fma(pr, vr[j], acc[r][j]);
      }
    }
    for (int r = 0; r < m; ++r)
      if (out[r] != nullptr) {
        const Vec scale = Set1(inv[r]);
        for (int j = 0; j < nv; ++j) Store(out[r] + j * kLanes, Mul(acc[r][j], scale));
      }
  }
};

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> mask,
                              ffi::ResultBuffer<ffi::F32> y, float scale, int64_t splits,
                              int64_t scores) {
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
  if (scores < 0 || scores > 2)
    return ffi::Error::InvalidArgument("scores must be 0 (chosen), 1 (dots) or 2 (lanes)");
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
  if (work->T == 0 || work->S == 0 || work->H == 0) return ffi::Error::Success();
  // The lanes layout's groups: as few as fit kLanes, as even as the count allows. It is
  // chosen where they fill at least 3/4 of the lanes: on AVX-512, 12-16 queries a group.
  const int64_t per_head = work->T * work->G;  // queries a KV head, >= 1
  const int64_t lane_groups = (per_head + kLanes - 1) / kLanes;
  const int64_t lane_group_size = (per_head + lane_groups - 1) / lane_groups;
  work->lanes = scores == 0 ? 4 * lane_group_size >= 3 * kLanes : scores == 2;
  work->group_size = work->lanes ? lane_group_size : kChunkQueries;
  work->groups_per_head = (per_head + work->group_size - 1) / work->group_size;
  const int64_t group_chunks = work->B * work->Hkv * work->groups_per_head;
  int64_t rows = 0, unused;
  for (int64_t b = 0; b < work->B; ++b) rows = std::max(rows, work->Visible(b, &unused));
  work->splits = splits > 0 ? std::min(splits, kMaxSplits)
                            : ChooseSplits(group_chunks, std::max<int64_t>(1, pool.num_threads()), rows);
  work->chunks = group_chunks * work->splits;
  if (work->splits > 1) {
    const int64_t parts = group_chunks * work->splits * work->group_size;
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
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("scores"));
