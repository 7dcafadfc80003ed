// Pool allocation speed, RMM random_allocations style: a rolling window of live allocations
// (sizes log-uniform in 256 B .. 64 MiB), each iteration allocates one block and frees a random
// live one. Reports ns per alloc+free pair (mean from Google Benchmark, median from per-pair
// timing, and the mean of one pass with no clock reads) for each pool mode and for plain
// malloc/free, side by side in one run. BM_pool_layers times the pool's layers interleaved in
// one process (this machine's speed phase is per process, so only ratios within one run are
// comparable): the best-fit pool alone, with a pointer table and the pool's lock, and the whole
// MemoryPool; `pool_over_layer` is the front's and adaptors' share.
//   replica_bench_pool [--benchmark_repetitions=3 ...] [--benchmark_filter=layers]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/memory/best_fit_pool.h"
#include "core/memory_pool.h"
#include "core/ptr_map.h"
#include "core/spin_lock.h"

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

// One pass of the pairs with no clock reads inside: ns per pair.
template <typename Alloc, typename Free>
double unclocked_pass(Alloc alloc, Free release) {
  const Plan& p = plan();
  std::vector<void*> live(kWindow);
  for (int i = 0; i < kWindow; ++i) live[i] = alloc(p.sizes[i]);
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t k = 0; k < kOps; ++k) {
    void* fresh = alloc(p.sizes[k]);
    void*& victim = live[p.victims[k]];
    release(victim);
    victim = fresh;
    benchmark::DoNotOptimize(fresh);
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kOps;
  for (void* v : live) release(v);
  return ns;
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
  for (void* v : live) release(v);
  // The same pairs once more with no clock read between them: the clock's reads wait for the
  // pair's work to finish (the vDSO orders rdtsc), so the per-pair median is the latency of one
  // pair on its own; this is the time a pair takes among others, as a program sees it.
  state.counters["unclocked_pair_ns"] = unclocked_pass(alloc, release);
  std::nth_element(pair_ns.begin(), pair_ns.begin() + pair_ns.size() / 2, pair_ns.end());
  state.counters["median_pair_ns"] = pair_ns[pair_ns.size() / 2];
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

void BM_pool_layers(benchmark::State& state) {
  const size_t bytes = size_t(16) << 30;
  PoolOptions o;
  o.mode = AllocatorMode::preallocate;
  o.bytes = bytes;
  MemoryPool pool({DeviceKind::cpu, 0}, std::make_unique<HostUpstream>(), o);
  LimitedUpstream limited(std::make_unique<HostUpstream>(), bytes);
  BestFitPool best_fit(&limited, std::make_unique<PreallocatePolicy>());
  detail::PtrMap<Allocation> table;
  detail::SpinLock lock;
  const auto request = [](size_t n) { return AllocRequest{(n + 255) & ~size_t(255), n, MemTag::activations, nullptr}; };
  std::vector<double> alone, layer, whole;
  for (auto _ : state) {
    for (int round = 0; round < 15; ++round) {
      {  // the best-fit pool alone: the caller keeps each handle in its window slot
        const Plan& p = plan();
        std::vector<Allocation> live(kWindow);
        for (int i = 0; i < kWindow; ++i) live[i] = best_fit.allocate(request(p.sizes[i]));
        const auto t0 = std::chrono::steady_clock::now();
        for (size_t k = 0; k < kOps; ++k) {
          const Allocation fresh = best_fit.allocate(request(p.sizes[k]));
          Allocation& victim = live[p.victims[k]];
          best_fit.deallocate(victim, {});
          victim = fresh;
          benchmark::DoNotOptimize(fresh.ptr);
        }
        alone.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kOps);
        for (auto& v : live) best_fit.deallocate(v, {});
      }
      layer.push_back(unclocked_pass(
          [&](size_t n) {
            std::lock_guard<detail::SpinLock> g(lock);
            const Allocation a = best_fit.allocate(request(n));
            table.insert(a.ptr, a);
            return a.ptr;
          },
          [&](void* q) {
            std::lock_guard<detail::SpinLock> g(lock);
            bool found = false;
            best_fit.deallocate(table.take(q, found), {});
          }));
      whole.push_back(unclocked_pass([&](size_t n) { return pool.allocate(n, MemTag::activations); },
                                     [&](void* q) { pool.deallocate(q); }));
    }
  }
  const auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  state.counters["best_fit_ns"] = median(alone);
  state.counters["with_table_lock_ns"] = median(layer);
  state.counters["pool_ns"] = median(whole);
  state.counters["pool_over_layer"] = median(whole) / median(layer);
}

}  // namespace

BENCHMARK(BM_pool_layers)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_timer_only)->Iterations(kOps);
BENCHMARK(BM_pool_preallocate)->Iterations(kOps);
BENCHMARK(BM_pool_growth)->Iterations(kOps);
BENCHMARK(BM_pool_platform)->Iterations(kOps / 8);
BENCHMARK(BM_malloc_free)->Iterations(kOps / 8);
BENCHMARK_MAIN();
