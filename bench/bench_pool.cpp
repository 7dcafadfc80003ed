// Pool allocation speed, RMM random_allocations style: a rolling window of live allocations
// (sizes log-uniform in 256 B .. 64 MiB), each iteration allocates one block and frees a random
// live one. Reports ns per alloc+free pair (mean from Google Benchmark, median from per-pair
// timing, and the mean of one pass with no clock reads) for each pool mode and for plain
// malloc/free, side by side in one run.
//   replica_bench_pool [--benchmark_repetitions=3 ...]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/memory_pool.h"

using namespace replica;

namespace {

constexpr int kWindow = 64;
constexpr size_t kOps = 1 << 16;

struct Plan {
  std::vector<size_t> sizes;
  std::vector<int> victims;
};

const Plan& plan() {
  static Plan p = [] {
    Plan q;
    std::mt19937_64 rng(123);
    std::uniform_real_distribution<double> d(8, 26);  // 2^8 = 256 B .. 2^26 = 64 MiB
    for (size_t i = 0; i < kOps; ++i) {
      q.sizes.push_back(static_cast<size_t>(std::exp2(d(rng))));
      q.victims.push_back(static_cast<int>(rng() % kWindow));
    }
    return q;
  }();
  return p;
}

template <typename Alloc, typename Free>
void run(benchmark::State& state, Alloc alloc, Free release) {
  const Plan& p = plan();
  std::vector<void*> live(kWindow, nullptr);
  for (int i = 0; i < kWindow; ++i) live[i] = alloc(p.sizes[i]);
  std::vector<double> pair_ns;
  pair_ns.reserve(kOps);
  size_t i = 0;
  for (auto _ : state) {
    const size_t k = i++ % kOps;
    auto t0 = std::chrono::steady_clock::now();
    void* fresh = alloc(p.sizes[k]);
    void*& victim = live[p.victims[k]];
    release(victim);
    auto t1 = std::chrono::steady_clock::now();
    victim = fresh;
    benchmark::DoNotOptimize(fresh);
    if (pair_ns.size() < kOps) pair_ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  // The same pairs once more with no clock read between them: the clock's reads wait for the
  // pair's work to finish (the vDSO orders rdtsc), so the per-pair median is the latency of one
  // pair on its own; this is the time a pair takes among others, as a program sees it.
  const auto u0 = std::chrono::steady_clock::now();
  for (size_t k = 0; k < kOps; ++k) {
    void* fresh = alloc(p.sizes[k]);
    void*& victim = live[p.victims[k]];
    release(victim);
    victim = fresh;
    benchmark::DoNotOptimize(fresh);
  }
  const double unclocked = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - u0).count();
  for (void* v : live) release(v);
  std::nth_element(pair_ns.begin(), pair_ns.begin() + pair_ns.size() / 2, pair_ns.end());
  state.counters["median_pair_ns"] = pair_ns[pair_ns.size() / 2];
  state.counters["unclocked_pair_ns"] = unclocked / kOps;
  state.SetItemsProcessed(state.iterations());
}

void pool_bench(benchmark::State& state, AllocatorMode mode) {
  PoolOptions o;
  o.mode = mode;
  o.bytes = size_t(16) << 30;  // virtual: pages are never touched
  MemoryPool pool({DeviceKind::cpu, 0}, std::make_unique<HostUpstream>(), o);
  run(state, [&](size_t n) { return pool.allocate(n, MemTag::activations); }, [&](void* q) { pool.deallocate(q); });
  auto s = pool.stats();
  state.counters["peak_reserved_MiB"] = s.peak_reserved / 1048576.0;
  state.counters["fragmentation"] = s.fragmentation;
}

void BM_pool_preallocate(benchmark::State& s) { pool_bench(s, AllocatorMode::preallocate); }
void BM_pool_growth(benchmark::State& s) { pool_bench(s, AllocatorMode::growth); }
void BM_pool_platform(benchmark::State& s) { pool_bench(s, AllocatorMode::platform); }
void BM_malloc_free(benchmark::State& s) {
  run(s, [](size_t n) { return std::malloc(n); }, [](void* q) { std::free(q); });
}

// The two clock reads around each pair, timed around nothing: the median_pair_ns figures above
// include this much measurement cost.
void BM_timer_only(benchmark::State& s) {
  run(s, [](size_t) { return static_cast<void*>(nullptr); }, [](void*) {});
}

}  // namespace

BENCHMARK(BM_timer_only)->Iterations(kOps);
BENCHMARK(BM_pool_preallocate)->Iterations(kOps);
BENCHMARK(BM_pool_growth)->Iterations(kOps);
BENCHMARK(BM_pool_platform)->Iterations(kOps / 8);
BENCHMARK(BM_malloc_free)->Iterations(kOps / 8);
BENCHMARK_MAIN();
