// A team: the threads of one OpenMP parallel region that run a whole decode_layers call together
// (cpu_decode.cpp), each doing a share of every kernel, meeting at a barrier between two kernels.
//
// Why not a parallel region per kernel: the engine workers run with a short OpenMP spin
// (GOMP_SPINCOUNT=1000, so that idle workers leave the cores to the API and other models), and in a
// VM a thread that falls asleep in the gap between two regions is slow to wake (the idle vCPU halts).
// A batch-1 decode step took 5.2 ms so against 4.0 ms with libgomp's long spin. This barrier spins
// while a call runs, then the region ends and the workers sleep as before: the spin lasts a call,
// not an idle engine. Past a short spin it yields the core, so a thread that shares it still runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <algorithm>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace gpushare::team {

class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}

  void wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);  // before the release: nobody leaves until then
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kPauses)
        pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static constexpr int kPauses = 2000;  // ~10-50 us, by the CPU's pause
  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
  const int threads_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
};

// f(i) for i in [0, n), each i claimed by whichever thread of the team comes for it first.
template <typename F>
void claim(std::atomic<int64_t>& next, int64_t n, F&& f) {
  for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
    f(i);
}

// claim, `chunk` consecutive i at a time: each thread reads a linear's weights in runs it can stream.
template <typename F>
void claim_runs(std::atomic<int64_t>& next, int64_t n, int64_t chunk, F&& f) {
  for (int64_t i = next.fetch_add(chunk, std::memory_order_relaxed); i < n; i = next.fetch_add(chunk, std::memory_order_relaxed))
    for (int64_t j = i; j < std::min(n, i + chunk); ++j) f(j);
}

}  // namespace gpushare::team
