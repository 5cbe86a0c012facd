// How the specjax CPU kernels share XLA's intra-op pool (Ctx<ThreadPool>): a call's work is
// cut into chunks claimed from an atomic counter by the caller and by helpers it schedules.
//
// The caller never waits for a helper that has not started: several custom calls can run at
// once and fill the pool, and a caller that waited for queued helpers would deadlock (the
// first rowdot did). It waits only for chunks a running helper has claimed, spinning and
// then yielding the core. The work lives in a shared_ptr, since a late helper may start after
// the call returned (it then finds no chunk and exits).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

// A kernel's work derives from this and defines ``void RunChunk(int64_t c)`` for c in
// [0, chunks).
struct PoolWork {
  int64_t chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <class Work>
void ClaimChunks(Work& work) {
  for (int64_t c; (c = work.next.fetch_add(1)) < work.chunks;) {
    work.RunChunk(c);
    work.done.fetch_add(1, std::memory_order_release);
  }
}

// Runs every chunk of ``work``, on helpers too when it has more than ``min_chunks_to_share``.
template <class Work>
void RunOnPool(xla::ffi::ThreadPool& pool, const std::shared_ptr<Work>& work,
               int64_t min_chunks_to_share) {
  const int64_t helpers = std::max<int64_t>(1, pool.num_threads()) - 1;
  if (work->chunks > min_chunks_to_share)
    for (int64_t p = 0; p < helpers; ++p) pool.Schedule([work] { ClaimChunks(*work); });
  ClaimChunks(*work);
  // The last chunks are a running helper's. Spin briefly, then yield: on a loaded machine
  // (more runnable threads than cores) that helper may be waiting for this very core.
  for (int spins = 0; work->done.load(std::memory_order_acquire) < work->chunks; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}
